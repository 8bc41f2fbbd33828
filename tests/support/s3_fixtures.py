"""Pytest fixtures for storage tests: a moto S3 server, a fault proxy in front of it, test credentials, fresh
buckets, a second moto server that checks credentials, and the local HF Hub server. Imported by
tests/component/conftest.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.fault_proxy import FaultProxy
from tests.support.hf_hub_server import HfHubServer

# Values only tests use; the credential tests assert they never show up in errors or logs.
TEST_ACCESS_KEY = "AKIAVIMEFLOWTEST0001"
TEST_SECRET_KEY = "vimeflow-test-secret-Zq8r7T2x9"


class ObsForbidOverwrite:
    """OBS's create-only PUT on the S3 server moto is: a PUT with `x-obs-forbid-overwrite: true` is served as S3's
    `If-None-Match: *` and moto's refusal (412 PreconditionFailed) answered as OBS answers (409 ObjectAlreadyExists).
    moto speaks S3 only; OBS takes its own header instead of S3's."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD") != "PUT" or environ.get("HTTP_X_OBS_FORBID_OVERWRITE", "").lower() != "true":
            return self.app(environ, start_response)
        environ["HTTP_IF_NONE_MATCH"] = "*"
        answer: dict = {}

        def keep(status, headers, exc_info=None):
            answer.update(status=status, headers=headers)
            return lambda data: None

        body = b"".join(self.app(environ, keep))
        if answer["status"].startswith("412"):
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ObjectAlreadyExists</Code>'
                    b"<Message>The object already exists.</Message></Error>")
            start_response("409 Conflict", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        start_response(answer["status"], answer["headers"])
        return [body]


def _s3_only_moto_server():
    """A threaded moto server that serves S3 to every request, as `moto_server s3` does.

    moto picks a request's service from the SigV4 credential scope in its Authorization header and reads an
    OBS or SigV2 header ("OBS ak:base64-signature") the same way, so a signature with exactly four '/' in it
    (about one request in 1,400) was sent to a made-up service and answered 500. A CI run failed on it."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import (
        DEFAULT_SERVICE_REGION,
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    service, region = DEFAULT_SERVICE_REGION
    assert service == "s3"

    class S3Dispatcher(DomainDispatcherApplication):
        def infer_service_region_host(self, environ, path):
            return f"{service}.{region}.amazonaws.com"

    class S3OnlyServer(ThreadedMotoServer):
        def _server_entry(self) -> None:  # ThreadedMotoServer's own, with the dispatcher above
            app = ObsForbidOverwrite(S3Dispatcher(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return S3OnlyServer(ip_address="127.0.0.1", port=0, verbose=False)


@pytest.fixture(scope="session")
def moto_endpoint():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = _s3_only_moto_server()
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@dataclass(frozen=True)
class CheckedS3:
    url: str
    access_key: str  # an IAM user's key, allowed s3:*
    secret_key: str


@pytest.fixture(scope="session")
def moto_with_iam() -> Iterator[CheckedS3]:
    """A moto server that authenticates every request as S3 does: SigV4 signatures checked against its IAM
    users (403 SignatureDoesNotMatch, InvalidAccessKeyId). moto reads INITIAL_NO_AUTH_ACTION_COUNT when it is
    imported, so this one runs in its own process; the count lets the three calls that make its only user
    through unsigned."""
    from tests.support.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", url.rsplit(":", 1)[1]],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.2)
        import boto3

        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="unsigned",
                           aws_secret_access_key="unsigned")
        iam.create_user(UserName="vimeflow")
        iam.put_user_policy(UserName="vimeflow", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="vimeflow")["AccessKey"]
        yield CheckedS3(url, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def storage_env(monkeypatch):
    """Credentials and settings in the environment, the way a worker or container receives them."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1", "OBS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
        "OBS_SECRET_ACCESS_KEY": TEST_SECRET_KEY, "OBS_REGION": "us-east-1", "OBS_PATH_STYLE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "OBS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fault_proxy(moto_endpoint):
    proxy = FaultProxy(moto_endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def make_bucket(moto_endpoint, storage_env):
    """Create a fresh bucket on moto (directly, not through the proxy); returns its name."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")

    def make() -> str:
        name = f"vf-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        return name

    return make


@pytest.fixture(scope="session")
def hf_hub():
    server = HfHubServer().start()
    yield server
    server.stop()


@pytest.fixture
def hf_endpoint(hf_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hf_hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hf_hub.url
