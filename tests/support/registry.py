"""A real Registry v2 for tests: Debian's ``docker-registry`` on a free port, with images pushed through
the registry HTTP API, and a small token service for the bearer flow.

Auth modes, one registry process each:
- ``none``: anonymous pull and push.
- ``htpasswd``: the registry's own Basic auth (bcrypt htpasswd file).
- ``token``: the registry's own token auth (``auth.token`` in its config). It answers 401 with
  ``WWW-Authenticate: Bearer realm=…,service=…,scope=…`` and accepts only JWTs signed by the key whose
  self-signed certificate is its ``rootcertbundle``. ``TokenService`` is that realm: it checks Basic
  credentials and issues such JWTs (RS256, the certificate in the ``x5c`` header), as Docker Hub,
  Harbor and SWR do. The same little server also answers SWR's temporary-login API
  (``POST /v2/manage/utils/secret``), so ``huaweicloudsdkswr`` can be exercised against it.

The registry binary comes from ``scripts/ci-system-deps-registry``; without it the fixtures fail loudly.
"""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from tests.support.ports import free_port

USER = "vimeflow-ci"
PASSWORD = "s3cret-registry-pw"
# bcrypt of PASSWORD (cost 4, fixed salt): made once with crypt(3), so tests need no bcrypt package.
_HTPASSWD = f"{USER}:$2b$04$abcdefghijklmnopqrstuuqAg2UVYa15QrwT3WwZjd4xWGUaJReKe\n"
SERVICE = "vimeflow-test-registry"
ISSUER = "vimeflow-test-token-service"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- token service (+ SWR login API)


@dataclass
class TokenService:
    """Issues registry JWTs to holders of ``USER``/``PASSWORD``; records what it was asked."""

    port: int = field(default_factory=free_port)
    scopes_requested: list[str] = field(default_factory=list)
    swr_authorizations: list[str] = field(default_factory=list)
    swr_registry_host: str = ""
    swr_ak: str = "AKTESTSWR0001"  # the only access key SWR's login API accepts

    def __post_init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                                  key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                  crl_sign=False, encipher_only=False, decipher_only=False),
                                    critical=True)
                     .sign(self.key, hashes.SHA256()))
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def mint(self, subject: str, access: list[dict]) -> str:
        """A JWT the registry accepts: RS256, certificate in ``x5c``, audience = the registry's service."""
        header = {"typ": "JWT", "alg": "RS256",
                  "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
                  "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"

    def push_token(self, repository: str) -> str:
        return self.mint(USER, [{"type": "repository", "name": repository, "actions": ["pull", "push"]}])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler_for(service: TokenService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlparse(self.path)
            if url.path != "/token":
                return self._json(404, {"errors": [{"code": "NOT_FOUND"}]})
            query = parse_qs(url.query)
            scope = query.get("scope", [""])[0]
            service.scopes_requested.append(scope)
            auth = self.headers.get("Authorization", "")
            user = None
            if auth.startswith("Basic "):
                u, _, p = base64.b64decode(auth[6:]).decode().partition(":")
                if (u, p) != (USER, PASSWORD):
                    return self._json(401, {"details": "incorrect username or password"})
                user = u
            access = []
            if user and scope.startswith("repository:"):
                _, name, actions = scope.split(":", 2)
                access = [{"type": "repository", "name": name, "actions": actions.split(",")}]
            token = service.mint(user or "", access)
            self._json(200, {"token": token, "access_token": token, "expires_in": 300})

        def do_POST(self) -> None:  # noqa: N802
            if urlparse(self.path).path != "/v2/manage/utils/secret":
                return self._json(404, {"error_code": "SVCSTG.SWR.4040000", "error_msg": "not found"})
            authorization = self.headers.get("Authorization", "")
            service.swr_authorizations.append(authorization)
            if not authorization.startswith(f"SDK-HMAC-SHA256 Access={service.swr_ak},"):
                return self._json(401, {"error_code": "SVCSTG.SWR.4010001", "error_msg": "Authenticate failed"})
            auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
            self._json(200, {"auths": {service.swr_registry_host: {"auth": auth}}},
                       {"X-Swr-Dockerlogin": f"docker login -u {USER} -p *** {service.swr_registry_host}",
                        "X-Swr-Expireat": "2099-01-01T00:00:00Z"})

    return Handler


# ---------------------------------------------------------------- the registry process


class Registry:
    """``docker-registry`` with filesystem storage under ``workdir``; ``auth`` is none|htpasswd|token."""

    def __init__(self, workdir: Path, auth: str = "none", token_service: TokenService | None = None):
        binary = shutil.which("docker-registry")
        if binary is None:
            raise RuntimeError("docker-registry is not installed: run scripts/ci-system-deps-registry")
        self.auth, self.token_service = auth, token_service
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        config = {"version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
                  "storage": {"filesystem": {"rootdirectory": str(workdir / "data")}, "delete": {"enabled": True}},
                  "http": {"addr": self.host, "secret": uuid.uuid4().hex}}
        if auth == "htpasswd":
            (workdir / "htpasswd").write_text(_HTPASSWD)
            config["auth"] = {"htpasswd": {"realm": "vimeflow-test", "path": str(workdir / "htpasswd")}}
        elif auth == "token":
            assert token_service is not None
            (workdir / "root.crt").write_bytes(token_service.cert_pem())
            config["auth"] = {"token": {"realm": token_service.realm, "service": SERVICE, "issuer": ISSUER,
                                        "rootcertbundle": str(workdir / "root.crt")}}
        (workdir / "config.yml").write_text(json.dumps(config))  # JSON is YAML
        self._log = open(workdir / "registry.log", "wb")
        self.process = subprocess.Popen([binary, "serve", str(workdir / "config.yml")],
                                        stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(workdir / "registry.log")

    def _wait_ready(self, log_path: Path, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.process.returncode}: {log_path.read_text()}")
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code in (200, 401):
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"docker-registry did not answer within {timeout}s: {log_path.read_text()}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def push_auth(self, repository: str) -> dict[str, str]:
        if self.auth == "htpasswd":
            return {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
        if self.auth == "token":
            return {"Authorization": f"Bearer {self.token_service.push_token(repository)}"}
        return {}

    # ------------------------------------------------------------ pushing through the registry API

    def push_blob(self, repository: str, data: bytes) -> str:
        digest = sha256_digest(data)
        headers = self.push_auth(repository)
        with httpx.Client(base_url=f"http://{self.host}", headers=headers, timeout=10) as client:
            start = client.post(f"/v2/{repository}/blobs/uploads/")
            assert start.status_code == 202, start.text
            # the Location carries upload state in its query: add the digest to it, do not replace it
            location = httpx.URL(start.headers["Location"]).copy_merge_params({"digest": digest})
            done = client.put(location, content=data,
                              headers={"Content-Type": "application/octet-stream"})
            assert done.status_code == 201, done.text
        return digest

    def push_manifest(self, repository: str, reference: str, manifest: dict, media_type: str) -> str:
        body = json.dumps(manifest).encode()
        response = httpx.put(f"http://{self.host}/v2/{repository}/manifests/{reference}", content=body,
                             headers={"Content-Type": media_type, **self.push_auth(repository)}, timeout=10)
        assert response.status_code == 201, response.text
        assert response.headers["Docker-Content-Digest"] == sha256_digest(body)
        return sha256_digest(body)

    def push_image(self, repository: str, tag: str | None, *, architecture: str,
                   labels: dict[str, str], os_: str = "linux") -> tuple[str, dict]:
        """One layer (a tiny tar.gz), a config with os/architecture/labels, an OCI manifest.

        Returns (manifest digest, index entry describing it)."""
        tar_bytes = io.BytesIO()
        with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
            payload = f"built for {architecture}\n".encode()
            info = tarfile.TarInfo("etc/vimeflow-image")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        layer = gzip.compress(tar_bytes.getvalue(), mtime=0)
        config = {"architecture": architecture, "os": os_, "config": {"Labels": labels},
                  "rootfs": {"type": "layers", "diff_ids": [sha256_digest(tar_bytes.getvalue())]}}
        config_bytes = json.dumps(config).encode()
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, "digest": self.push_blob(repository, config_bytes),
                               "size": len(config_bytes)},
                    "layers": [{"mediaType": OCI_LAYER, "digest": self.push_blob(repository, layer),
                                "size": len(layer)}]}
        body_size = len(json.dumps(manifest).encode())
        digest = self.push_manifest(repository, tag or sha256_digest(json.dumps(manifest).encode()),
                                    manifest, OCI_MANIFEST)
        entry = {"mediaType": OCI_MANIFEST, "digest": digest, "size": body_size,
                 "platform": {"architecture": architecture, "os": os_}}
        return digest, entry

    def push_index(self, repository: str, tag: str, entries: list[dict]) -> str:
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        return self.push_manifest(repository, tag, index, OCI_INDEX)
