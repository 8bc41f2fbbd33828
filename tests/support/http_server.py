"""A local HTTP server on 127.0.0.1 in a background thread: the lifecycle the fake services share."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[str, dict[str, str], Any], tuple[int, Any]]  # (path, headers, body) -> (status, JSON body)


class BackgroundHTTPServer:
    """Binds a free port at construction; `start()` serves in a daemon thread, `stop()` closes the socket."""

    def __init__(self, handler_class: type[BaseHTTPRequestHandler]):
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class StandIn(BackgroundHTTPServer):
    """A local service answering every POST with `answer` (and every GET, a health check, with an empty 200);
    `requests` holds what it was POSTed."""

    def __init__(self, answer: Answer):
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {k.lower(): v for k, v in self.headers.items()}
                outer.requests.append((self.path, headers, body))
                status, reply = answer(self.path, headers, body)
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(Handler)
