"""Pytest fixtures for storage tests: a moto S3 server, a fault proxy in front of it, test credentials, fresh
buckets, a second moto server that checks credentials, and the local HF Hub server. Imported by
tests/component/conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.fault_proxy import FaultProxy
from tests.support.hf_hub_server import HfHubServer

REPO = Path(__file__).resolve().parents[2]

# Values only tests use; the credential tests assert they never show up in errors or logs.
TEST_ACCESS_KEY = "AKIAVIMEFLOWTEST0001"
TEST_SECRET_KEY = "vimeflow-test-secret-Zq8r7T2x9"


@pytest.fixture(scope="session")
def moto_endpoint():
    """The S3 server of tests/support/moto_s3_server.py, in a process of its own: moto's server imports Flask, whose
    context-local proxies make vLLM's kernel registration fail in any process that then builds an engine."""
    from tests.support.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    proc = _start_server([sys.executable, "-m", "tests.support.moto_s3_server", url.rsplit(":", 1)[1]], url,
                         {"PYTHONPATH": str(REPO)})
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _start_server(argv: list[str], url: str, env: dict[str, str]) -> subprocess.Popen:
    """Start a moto server and wait until it answers."""
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/moto-api/", timeout=2)
            return proc
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.2)


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
    proc = _start_server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", url.rsplit(":", 1)[1]], url,
                         {"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
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
