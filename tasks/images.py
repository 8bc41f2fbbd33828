"""Check a container image in its registry before a run downloads anything.

``check_image(reference, requirements)`` speaks the Registry v2 / OCI distribution HTTP API with httpx:
it resolves the reference (a tag or a digest) to a manifest, picks the wanted platform out of a
manifest list / OCI index, reads the image config blob for architecture and labels, and checks them
against ``ImageRequirements``. Each way of failing has its own error type, whose message names what
was wanted and what was found. Plain functions, no Prefect and no engine: the pipeline wraps them.

Auth follows the registry's ``WWW-Authenticate`` challenge, as the Docker client does: ``Basic`` gets
the credentials directly; ``Bearer realm=…,service=…,scope=…`` (Docker Hub, Harbor, SWR) gets a token
from the realm, with the credentials as basic auth when there are any. Credentials come explicitly, from
a docker ``config.json`` (``auths.<host>.auth``), or for SWR from its temporary-login API
(``swr_login_credentials``). They never appear in messages.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, Field, field_validator

DOCKER_HUB = "docker.io"
_DOCKER_HUB_API = "registry-1.docker.io"
_DOCKER_HUB_CONFIG_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")

# The names Go (and so every registry) uses, keyed by what `uname -m` and people say.
_ARCH_ALIASES = {"aarch64": "arm64", "x86_64": "amd64", "x86-64": "amd64", "armhf": "arm", "i386": "386"}


# ---------------------------------------------------------------- errors


class ImageCheckError(Exception):
    """The image failed a check; the message names the difference."""


class ImageNotFoundError(ImageCheckError):
    """The repository, tag or digest does not exist in the registry."""


class PlatformMismatchError(ImageCheckError):
    """The image (or no entry of its index) is built for the wanted platform."""


class LabelCheckError(ImageCheckError):
    """One or more label constraints failed; ``failures`` holds one line per label."""

    def __init__(self, reference: str, failures: list[str]):
        self.failures = failures
        super().__init__(f"image {reference}: label check failed: " + "; ".join(failures))


class RegistryAuthError(ImageCheckError):
    """The registry refused the credentials (or needs some and got none)."""


class RegistryError(ImageCheckError):
    """Any other registry failure: unexpected status, bad digest, unreachable host."""


# ---------------------------------------------------------------- reference


@dataclass(frozen=True)
class ImageReference:
    """A parsed image reference: ``[registry/]repository[:tag][@digest]``."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def api_host(self) -> str:
        return _DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def manifest_ref(self) -> str:
        """What to ask the registry for: the digest when pinned, else the tag (``latest`` by default)."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"{self.registry}/{self.repository}{tag}{digest}"


_DIGEST_RE = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-fA-F0-9]{32,}$")


def parse_reference(reference: str) -> ImageReference:
    """Split a reference the way the Docker client does.

    The first path component is a registry host when it contains ``.`` or ``:`` or is ``localhost``;
    otherwise the image is on Docker Hub, where one-component names live under ``library/``.
    """
    rest, _, digest = reference.strip().partition("@")
    if digest and not _DIGEST_RE.match(digest):
        raise ValueError(f"invalid digest in image reference {reference!r}")
    name, tag = rest, None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = rest.rpartition(":")
    first, sep, remainder = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, remainder
    else:
        registry, repository = DOCKER_HUB, name
        if "/" not in repository:
            repository = f"library/{repository}"
    if not repository or repository != repository.lower() or (tag is not None and not tag):
        raise ValueError(f"invalid image reference {reference!r}")
    return ImageReference(registry, repository, tag, digest or None)


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


# ---------------------------------------------------------------- credentials


@dataclass(frozen=True)
class RegistryCredentials:
    username: str
    password: str = field(repr=False)


def docker_config_credentials(registry: str, config_path: str | Path | None = None) -> RegistryCredentials | None:
    """Credentials for ``registry`` from a docker ``config.json`` (``$DOCKER_CONFIG`` or ``~/.docker``).

    Reads ``auths.<host>.auth`` (base64 ``user:password``) or ``username``/``password``; Docker Hub is
    looked up under its historical keys too. Credential helpers (``credsStore``) are not consulted.
    """
    if config_path is None:
        config_path = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    path = Path(config_path)
    if not path.is_file():
        return None
    auths = json.loads(path.read_text()).get("auths", {})
    keys = _DOCKER_HUB_CONFIG_KEYS if registry == DOCKER_HUB else (registry, f"https://{registry}",
                                                                     f"http://{registry}")
    for key in keys:
        entry = auths.get(key)
        if entry:
            return credentials_from_auth_entry(entry)
    return None


def credentials_from_auth_entry(entry: dict) -> RegistryCredentials:
    """An ``auths`` entry (docker config or SWR's temporary login) as credentials."""
    if entry.get("auth"):
        user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        return RegistryCredentials(user, password)
    return RegistryCredentials(entry["username"], entry["password"])


def swr_login_credentials(ak: str, sk: str, project_id: str, region: str, *,
                          endpoint: str | None = None) -> dict[str, RegistryCredentials]:
    """Temporary docker-login credentials for SWR through ``huaweicloudsdkswr`` (``CreateSecret``).

    Returns ``{registry host: credentials}``; the SDK signs the call with AK/SK. ``endpoint`` overrides
    the region's SWR API endpoint (tests point it at a local server).
    """
    from huaweicloudsdkcore.auth.credentials import BasicCredentials
    from huaweicloudsdkswr.v2 import CreateSecretRequest, SwrClient
    from huaweicloudsdkswr.v2.region.swr_region import SwrRegion

    from huaweicloudsdkcore.exceptions.exceptions import SdkException, ServiceResponseException

    builder = SwrClient.new_builder().with_credentials(BasicCredentials(ak, sk, project_id))
    builder = builder.with_endpoints([endpoint]) if endpoint else builder.with_region(SwrRegion.value_of(region))
    try:
        response = builder.build().create_secret(CreateSecretRequest())
    except ServiceResponseException as exc:
        raise RegistryAuthError(f"SWR temporary login failed (HTTP {exc.status_code}, {exc.error_code}): "
                                f"{exc.error_msg}") from None
    except SdkException as exc:
        raise RegistryError(f"SWR temporary login failed: {type(exc).__name__}") from None
    return {host: credentials_from_auth_entry(info.to_dict()) for host, info in (response.auths or {}).items()}


# ---------------------------------------------------------------- registry client


def _is_loopback(host: str) -> bool:
    name = host[1:host.index("]")] if host.startswith("[") else host.split(":")[0]
    return name in {"localhost", "::1"} or name.startswith("127.")


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


class _RegistrySession:
    """One repository on one registry: GETs that answer the auth challenge once and reuse the token."""

    def __init__(self, ref: ImageReference, credentials: RegistryCredentials | None, *,
                 scheme: str | None, timeout: float, verify: bool | str):
        self.ref = ref
        self.credentials = credentials
        self.base = f"{scheme or ('http' if _is_loopback(ref.api_host) else 'https')}://{ref.api_host}"
        self.client = httpx.Client(timeout=timeout, verify=verify, follow_redirects=True)
        self.auth_header: str | None = None

    def close(self) -> None:
        self.client.close()

    def get(self, path: str, accept: tuple[str, ...] = ()) -> httpx.Response:
        url = f"{self.base}/v2/{self.ref.repository}/{path}"
        headers = {"Accept": ", ".join(accept)} if accept else {}
        response = self._send(url, headers)
        if response.status_code == 401 and self._answer(response):
            response = self._send(url, headers)
        if response.status_code == 401:
            who = "the given credentials" if self.credentials else "anonymous access"
            raise RegistryAuthError(f"registry {self.ref.registry} refused {who} to {self.ref.repository} "
                                    f"(HTTP 401{_error_codes(response)})")
        return response

    def _send(self, url: str, headers: dict[str, str]) -> httpx.Response:
        if self.auth_header:
            headers = {**headers, "Authorization": self.auth_header}
        try:
            return self.client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryError(f"registry {self.ref.registry} unreachable: {type(exc).__name__}: {exc}") from None

    def _answer(self, response: httpx.Response) -> bool:
        """Set the Authorization header the challenge asks for; False when there is nothing new to try."""
        if self.auth_header is not None:
            return False
        scheme, params = _parse_challenge(response.headers.get("WWW-Authenticate", ""))
        basic = (self.credentials.username, self.credentials.password) if self.credentials else None
        if scheme == "basic":
            if basic is None:
                raise RegistryAuthError(f"registry {self.ref.registry} requires credentials (Basic auth) "
                                        f"for {self.ref.repository} and none were given")
            self.auth_header = "Basic " + base64.b64encode(":".join(basic).encode()).decode()
            return True
        if scheme != "bearer" or "realm" not in params:
            raise RegistryError(f"registry {self.ref.registry}: unsupported auth challenge {scheme!r}")
        query = {k: params[k] for k in ("service", "scope") if k in params}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull")
        try:
            token_response = self.client.get(params["realm"], params=query, auth=basic)
        except httpx.HTTPError as exc:
            raise RegistryError(f"token service of {self.ref.registry} unreachable: {type(exc).__name__}") from None
        if token_response.status_code in (401, 403):
            raise RegistryAuthError(f"token service of {self.ref.registry} refused the given credentials "
                                    f"for {query['scope']} (HTTP {token_response.status_code})")
        if token_response.status_code != 200:
            raise RegistryError(f"token service of {self.ref.registry} answered HTTP {token_response.status_code}")
        body = token_response.json()
        token = body.get("token") or body.get("access_token")
        if not token:
            raise RegistryError(f"token service of {self.ref.registry} returned no token")
        self.auth_header = f"Bearer {token}"
        return True


def _error_codes(response: httpx.Response) -> str:
    try:
        codes = [e.get("code", "") for e in response.json().get("errors", [])]
    except (ValueError, AttributeError):
        return ""
    return f": {', '.join(c for c in codes if c)}" if any(codes) else ""


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _checked_body(response: httpx.Response, digest: str | None, what: str) -> bytes:
    """The body, verified against ``digest`` when the digest is sha256 (the only algorithm in use)."""
    body = response.content
    if digest and digest.startswith("sha256:") and _sha256(body) != digest:
        raise RegistryError(f"{what}: content does not match digest {digest} (got {_sha256(body)})")
    return body


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
    session = _RegistrySession(ref, credentials, scheme=scheme, timeout=timeout, verify=verify)
    try:
        return _check(session, ref, requirements)
    finally:
        session.close()


def _get_manifest(session: _RegistrySession, ref: ImageReference, manifest_ref: str) -> tuple[dict, str]:
    response = session.get(f"manifests/{manifest_ref}", accept=INDEX_TYPES + MANIFEST_TYPES)
    if response.status_code == 404:
        raise ImageNotFoundError(_not_found_message(session, ref, manifest_ref))
    if response.status_code != 200:
        raise RegistryError(f"image {ref}: manifest request answered HTTP {response.status_code}{_error_codes(response)}")
    # a pinned reference must match its digest; a tag must match the digest the registry claims for it
    expected = manifest_ref if manifest_ref.startswith("sha256:") else response.headers.get("Docker-Content-Digest")
    body = _checked_body(response, expected, f"image {ref} manifest")
    return json.loads(body), expected or _sha256(body)


def _not_found_message(session: _RegistrySession, ref: ImageReference, manifest_ref: str) -> str:
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


def _check(session: _RegistrySession, ref: ImageReference, req: ImageRequirements) -> ImageInfo:
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
    config = json.loads(_checked_body(response, config_digest, f"image {ref} config"))
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
