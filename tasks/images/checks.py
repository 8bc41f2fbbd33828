"""What a run asks of its image (`ImageRequirements`), what the registry says of it (`ImageInfo`), and
`check_image`, which compares the two."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, Field, field_validator

from tasks.images.registry import (
    INDEX_TYPES, MANIFEST_TYPES, ImageNotFoundError, ImageReference, LabelCheckError, PlatformMismatchError,
    RegistryCredentials, RegistryError, RegistrySession, checked_body, docker_config_credentials, error_codes,
    sha256_digest,
    parse_reference,
)

# The names Go (and so every registry) uses, keyed by what `uname -m` and people say.
_ARCH_ALIASES = {"aarch64": "arm64", "x86_64": "amd64", "x86-64": "amd64", "armhf": "arm", "i386": "386"}


# ---------------------------------------------------------------- requirements and result


def normalize_architecture(arch: str) -> str:
    arch = arch.strip().lower()
    return _ARCH_ALIASES.get(arch, arch)


_CONSTRAINT_RE = re.compile(r"^\s*(?P<key>[^\s<>=!]+)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>\S+)\s*$")
_OPS = {"==": Version.__eq__, "!=": Version.__ne__, ">=": Version.__ge__, "<=": Version.__le__,
        ">": Version.__gt__, "<": Version.__lt__}


@dataclass(frozen=True)
class LabelConstraint:
    """``<label> <op> <version>``, compared with ``packaging.version`` (so ``0.9 == 0.9.0``)."""

    key: str
    op: str
    version: Version

    @classmethod
    def parse(cls, text: str) -> "LabelConstraint":
        m = _CONSTRAINT_RE.match(text)
        if not m:
            raise ValueError(f"label constraint {text!r} is not '<label> <op> <version>' with op in {list(_OPS)}")
        try:
            version = Version(m["value"])
        except InvalidVersion as exc:
            raise ValueError(f"label constraint {text!r}: {m['value']!r} is not a version") from exc
        return cls(m["key"], m["op"], version)

    def failure(self, labels: dict[str, str]) -> str | None:
        """None when satisfied, else a line naming what was wanted and what was found."""
        wanted = f"{self.key}: wanted {self.op} {self.version}"
        found = labels.get(self.key)
        if found is None:
            return f"{wanted}, found no such label"
        try:
            ok = _OPS[self.op](Version(found), self.version)
        except InvalidVersion:
            return f"{wanted}, found {found!r} (not a version)"
        return None if ok else f"{wanted}, found {found}"


class ImageRequirements(BaseModel):
    """What a run needs from its image.

    ``architecture`` (``arm64`` for Ascend A2/A3; ``aarch64``/``x86_64`` are accepted), ``os``, an optional
    ``variant``; ``label_constraints`` like ``"org.vimeflow.vllm-ascend >= 0.9"``; ``labels`` that must
    match exactly.
    """

    architecture: str | None = None
    os: str = "linux"
    variant: str | None = None
    label_constraints: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("architecture")
    @classmethod
    def _normalize(cls, value: str | None) -> str | None:
        return normalize_architecture(value) if value else None

    @field_validator("label_constraints")
    @classmethod
    def _parse_check(cls, value: list[str]) -> list[str]:
        for text in value:
            LabelConstraint.parse(text)
        return value

    def platform(self) -> str:
        return _platform_str(self.os, self.architecture or "*", self.variant)

    def label_failures(self, labels: dict[str, str]) -> list[str]:
        failures = [f for c in self.label_constraints if (f := LabelConstraint.parse(c).failure(labels))]
        for key, wanted in self.labels.items():
            found = labels.get(key)
            if found != wanted:
                failures.append(f"{key}: wanted == {wanted!r}, found "
                                + ("no such label" if found is None else repr(found)))
        return failures


class ImageInfo(BaseModel):
    """What the check found. ``digest`` is what the reference points at (an index for multi-arch
    images: pin runs to it); ``manifest_digest`` is the chosen platform's manifest."""

    reference: str
    registry: str
    repository: str
    tag: str | None
    digest: str
    manifest_digest: str
    config_digest: str
    platform: str
    labels: dict[str, str]


def _platform_str(os_: str, arch: str, variant: str | None) -> str:
    return f"{os_}/{arch}" + (f"/{variant}" if variant else "")


# ---------------------------------------------------------------- the check


def check_image(reference: str, requirements: ImageRequirements | None = None, *,
                credentials: RegistryCredentials | None = None, docker_config: str | Path | None = None,
                scheme: str | None = None, timeout: float = 30.0, verify: bool | str = True) -> ImageInfo:
    """Confirm ``reference`` exists, resolve it to one platform, read its config and check it.

    Order: manifest (404 → ``ImageNotFoundError``); an index is resolved to the entry matching the
    required os/architecture/variant (none → ``PlatformMismatchError`` listing what is there); the config
    blob's os/architecture are checked again (a single-platform image is only known there); then labels
    (``LabelCheckError`` lists every failed label). ``scheme`` defaults to http for loopback registries.
    """
    requirements = requirements or ImageRequirements()
    ref = parse_reference(reference)
    if credentials is None:
        credentials = docker_config_credentials(ref.registry, docker_config)
    session = RegistrySession(ref, credentials, scheme=scheme, timeout=timeout, verify=verify)
    try:
        return _check(session, ref, requirements)
    finally:
        session.close()


def _get_manifest(session: RegistrySession, ref: ImageReference, manifest_ref: str) -> tuple[dict, str]:
    response = session.get(f"manifests/{manifest_ref}", accept=INDEX_TYPES + MANIFEST_TYPES)
    if response.status_code == 404:
        raise ImageNotFoundError(_not_found_message(session, ref, manifest_ref))
    if response.status_code != 200:
        raise RegistryError(f"image {ref}: manifest request answered HTTP {response.status_code}{error_codes(response)}")
    # a pinned reference must match its digest; a tag must match the digest the registry claims for it
    expected = manifest_ref if manifest_ref.startswith("sha256:") else response.headers.get("Docker-Content-Digest")
    body = checked_body(response, expected, f"image {ref} manifest")
    return json.loads(body), expected or sha256_digest(body)


def _not_found_message(session: RegistrySession, ref: ImageReference, manifest_ref: str) -> str:
    """Tell a missing repository from a missing tag (registries answer MANIFEST_UNKNOWN for both) by
    listing the repository's tags, and name the tags that are there."""
    what = "digest" if manifest_ref.startswith("sha256:") else "tag"
    tags = session.get("tags/list")
    if tags.status_code == 404:
        return f"image {ref}: repository not found in registry {ref.registry} (repository {ref.repository})"
    present = (tags.json().get("tags") or []) if tags.status_code == 200 else []
    shown = ", ".join(sorted(present)[:20]) + (", …" if len(present) > 20 else "")
    return (f"image {ref}: {what} not found in registry {ref.registry} (repository {ref.repository}, wanted "
            f"{what} {manifest_ref}, found tags: {shown or 'none'})")


def _choose(index: dict, ref: ImageReference, req: ImageRequirements) -> dict:
    entries = [m for m in index.get("manifests", []) if m.get("platform", {}).get("os") != "unknown"]
    for entry in entries:
        p = entry.get("platform", {})
        if (p.get("os") == req.os
                and (req.architecture is None or normalize_architecture(p.get("architecture", "")) == req.architecture)
                and (req.variant is None or p.get("variant") == req.variant)):
            return entry
    found = ", ".join(_platform_str(e["platform"].get("os", "?"), e["platform"].get("architecture", "?"),
                                    e["platform"].get("variant")) for e in entries if "platform" in e)
    raise PlatformMismatchError(f"image {ref}: wanted platform {req.platform()}, found only {found or 'none'}")


def _check(session: RegistrySession, ref: ImageReference, req: ImageRequirements) -> ImageInfo:
    manifest, digest = _get_manifest(session, ref, ref.manifest_ref)
    manifest_digest = digest
    if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
        manifest_digest = _choose(manifest, ref, req)["digest"]
        manifest, _ = _get_manifest(session, ref, manifest_digest)
    config_digest = manifest.get("config", {}).get("digest")
    if not config_digest:
        raise RegistryError(f"image {ref}: manifest {manifest_digest} has no config (media type "
                            f"{manifest.get('mediaType')!r} is not supported)")
    response = session.get(f"blobs/{config_digest}")
    if response.status_code != 200:
        raise RegistryError(f"image {ref}: config blob {config_digest} answered HTTP {response.status_code}")
    config = json.loads(checked_body(response, config_digest, f"image {ref} config"))
    arch = normalize_architecture(config.get("architecture", ""))
    platform = _platform_str(config.get("os", ""), arch, config.get("variant"))
    if (config.get("os") != req.os or (req.architecture and arch != req.architecture)
            or (req.variant and config.get("variant") != req.variant)):
        raise PlatformMismatchError(f"image {ref}: wanted platform {req.platform()}, found {platform}")
    labels = dict((config.get("config") or {}).get("Labels") or {})
    failures = req.label_failures(labels)
    if failures:
        raise LabelCheckError(str(ref), failures)
    return ImageInfo(reference=str(ref), registry=ref.registry, repository=ref.repository, tag=ref.tag,
                     digest=digest, manifest_digest=manifest_digest, config_digest=config_digest,
                     platform=platform, labels=labels)
