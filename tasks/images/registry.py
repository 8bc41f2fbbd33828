"""The registry side of an image check: references, credentials, and an authenticated session on one
repository that speaks the Registry v2 / OCI distribution HTTP API (httpx)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx

DOCKER_HUB = "docker.io"
_DOCKER_HUB_API = "registry-1.docker.io"
_DOCKER_HUB_CONFIG_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")


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


class RegistrySession:
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
                                    f"(HTTP 401{error_codes(response)})")
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


def error_codes(response: httpx.Response) -> str:
    try:
        codes = [e.get("code", "") for e in response.json().get("errors", [])]
    except (ValueError, AttributeError):
        return ""
    return f": {', '.join(c for c in codes if c)}" if any(codes) else ""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def checked_body(response: httpx.Response, digest: str | None, what: str) -> bytes:
    """The body, verified against ``digest`` when the digest is sha256 (the only algorithm in use)."""
    body = response.content
    if digest and digest.startswith("sha256:") and sha256_digest(body) != digest:
        raise RegistryError(f"{what}: content does not match digest {digest} (got {sha256_digest(body)})")
    return body
