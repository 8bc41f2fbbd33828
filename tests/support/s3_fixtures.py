"""Pytest fixtures for storage tests: a moto S3 server, a fault proxy in front of it, test credentials, fresh
buckets, and the local HF Hub server. Imported by tests/component/conftest.py."""

from __future__ import annotations

import logging
import uuid

import pytest

from tests.support.fault_proxy import FaultProxy
from tests.support.hf_hub_server import HfHubServer

# Values only tests use; the credential tests assert they never show up in errors or logs.
TEST_ACCESS_KEY = "AKIAVIMEFLOWTEST0001"
TEST_SECRET_KEY = "vimeflow-test-secret-Zq8r7T2x9"


@pytest.fixture(scope="session")
def moto_endpoint():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


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
