"""`vimeflow reward-server`: a reward function behind HTTP, in the format `remote.py` documents.

`POST /` with `{"prompt", "response", "label", "id"?}` answers 200 with `{"reward": float, "id": id}`, or with
the bare reward when the request has no id (what slime's `remote_rm` client reads); a malformed request
answers 400 and a reward function that raises answers 500, each with `{"error": message}`. `GET /health`
answers `{"status": "ok", "rm_type": ..., "served": rewards given so far}`.

The standard library's threading HTTP server: one thread per connection, keep-alive (HTTP/1.1). Grading runs
in those threads, so math-verify runs without its SIGALRM timeout there, as in the rollout workers.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vime_engine.rewards.custom import RewardFn

_MAX_BODY_BYTES = 16 * 1024 * 1024


class _BadRequest(ValueError):
    pass


class RewardServer(ThreadingHTTPServer):
    """Serves `reward_fn` on `host:port` (port 0: a free one; see `url`). `served` counts the rewards given."""

    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: the default 5 drops connections under a burst of clients

    def __init__(self, reward_fn: RewardFn, rm_type: str, host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _RewardHandler)
        self.reward_fn, self.rm_type = reward_fn, rm_type
        self.served = 0
        self._count_lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def count_served(self) -> None:
        with self._count_lock:
            self.served += 1


class _RewardHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body waits for the client's
    # delayed ACK, about 40 ms per request on a keep-alive connection.
    disable_nagle_algorithm = True
    server: RewardServer

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        if self.path == "/health":
            self._answer(200, {"status": "ok", "rm_type": self.server.rm_type, "served": self.server.served})
        else:
            self._answer(404, {"error": f"GET {self.path}: not found; POST / scores a response, GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/":
            self._drain()
            self._answer(404, {"error": f"POST {self.path}: not found; POST / scores a response"})
            return
        try:
            request = _parse(self._body())
        except _BadRequest as exc:
            self._answer(400, {"error": str(exc)})
            return
        try:
            reward = float(self.server.reward_fn(request["response"], request["label"]))
        except Exception as exc:  # a grader bug is the server's failure, not the client's: 500
            self._answer(500, {"error": f"{self.server.rm_type} reward raised {exc!r}"})
            return
        self.server.count_served()
        self._answer(200, {"reward": reward, "id": request["id"]} if "id" in request else reward)

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise _BadRequest("a JSON body with a Content-Length header is required")
        if int(length) > _MAX_BODY_BYTES:
            self.close_connection = True
            raise _BadRequest(f"body of {length} bytes is over the {_MAX_BODY_BYTES} byte limit")
        return self.rfile.read(int(length))

    def _drain(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= _MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _answer(self, status: int, body: Any) -> None:
        send_json(self, status, body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per request would drown the console; errors go back to the client in the body


def send_json(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    """Answer `handler`'s request with `body` as JSON (the reward server's and the retrieval server's answers)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _parse(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise _BadRequest('expected a JSON object {"prompt", "response", "label", "id"}')
    for key in ("response", "label"):
        if not isinstance(request.get(key), str):
            raise _BadRequest(f'"{key}" must be a string; got {request.get(key)!r}')
    return request


def serve(reward_fn: RewardFn, rm_type: str, host: str, port: int, on_ready=None) -> None:
    """Serve until interrupted; `on_ready(url)` is called once the socket listens."""
    with RewardServer(reward_fn, rm_type, host, port) as server:
        if on_ready is not None:
            on_ready(server.url)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
