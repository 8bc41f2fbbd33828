"""Reading `--ray-address`: the head's host and port, and whether the cluster is on loopback (the driver then
joins as a loopback node; vime_engine.runtime.cluster)."""

from __future__ import annotations

import pytest

from vime_engine.config import ConfigError
from vime_engine.runtime.cluster import head_host_port, is_loopback_address


@pytest.mark.parametrize(("address", "expected"), [
    ("10.0.0.5:6379", ("10.0.0.5", 6379)),
    ("ray://head.example:10001", ("head.example", 10001)),
    ("[::1]:6379", ("::1", 6379)),
    ("auto", None),
])
def test_head_host_port(address, expected):
    assert head_host_port(address) == expected


@pytest.mark.parametrize("address", ["10.0.0.5", ":6379", "head:port"])
def test_a_malformed_address_is_refused_naming_the_flag(address):
    with pytest.raises(ConfigError, match=f"--ray-address {address}: expected HOST:PORT"):
        head_host_port(address)


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True), ("127.0.0.2:1", True),
    ("10.0.0.5:6379", False), ("head.example:6379", False), ("auto", False), (None, False), ("10.0.0.5", False),
])
def test_is_loopback_address(address, loopback):
    assert is_loopback_address(address) is loopback
