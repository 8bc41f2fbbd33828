"""A TCP port on 127.0.0.1 free at the time of asking, for the test servers this suite starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
