"""A reverse proxy in front of an S3-compatible endpoint (moto) that injects real-looking faults.

Clients (boto3, the OBS SDK) talk HTTP to the proxy exactly as to S3/OBS. Rules, matched in order, can:

- answer with an S3 error (500 InternalError, 503 ServiceUnavailable, 403 AccessDenied) instead of
  forwarding;
- forward the request, then send the response headers and only half the body and close the connection
  (a connection dropped mid-transfer);
- read the request and close the connection without any answer (a server that hangs up);
- refuse every access key except the ones registered, with the body real S3 sends for an unknown key
  (403 InvalidAccessKeyId). moto does not check signatures, so this is where "wrong credentials" lives;
  a wrong secret with a known key id is not detected here.

Every exchange is logged (method, path, query, status) so tests can count, e.g., which parts were uploaded.
"""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from tests.support.http_server import BackgroundHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "expect", "upgrade", "te"}
_AK_RE = re.compile(r"Credential=([^/,\s]+)/|^(?:AWS|OBS) ([^:\s]+):")
_MESSAGES = {
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Please reduce your request rate.",
    "AccessDenied": "Access Denied",
}


@dataclass(frozen=True)
class Exchange:
    method: str
    path: str
    query: dict[str, list[str]]
    status: int
    access_key: str | None

    @property
    def part_number(self) -> int | None:
        return int(self.query["partNumber"][0]) if "partNumber" in self.query else None


@dataclass
class Rule:
    match: Callable[[str, str, dict], bool]  # (method, path, query) -> bool
    action: str  # "error" | "drop" | "hang_up"
    times: int  # how many matching requests it applies to; after `skip` matches
    status: int = 503
    code: str = "ServiceUnavailable"
    skip: int = 0
    seen: int = field(default=0)


def is_upload_part(method: str, path: str, query: dict) -> bool:
    return method == "PUT" and "partNumber" in query and "uploadId" in query


class FaultProxy(BackgroundHTTPServer):
    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.upstream_host, self.upstream_port = u.hostname, u.port
        self.rules: list[Rule] = []
        self.allowed_keys: set[str] | None = None
        self.log: list[Exchange] = []
        self._lock = threading.Lock()
        super().__init__(self._handler_class())

    def reset(self) -> None:
        with self._lock:
            self.rules.clear()
            self.log.clear()
            self.allowed_keys = None

    # ---- rule helpers ------------------------------------------------------------------------------------
    def fail(self, times: int, *, status: int = 503, code: str = "ServiceUnavailable", skip: int = 0,
             match: Callable[[str, str, dict], bool] = lambda m, p, q: True) -> Rule:
        rule = Rule(match, "error", times, status, code, skip)
        self.rules.append(rule)
        return rule

    def drop(self, times: int, *, skip: int = 0,
             match: Callable[[str, str, dict], bool] = lambda m, p, q: m == "GET") -> Rule:
        rule = Rule(match, "drop", times, skip=skip)
        self.rules.append(rule)
        return rule

    def hang_up(self, times: int, *, skip: int = 0,
                match: Callable[[str, str, dict], bool] = lambda m, p, q: True) -> Rule:
        rule = Rule(match, "hang_up", times, skip=skip)
        self.rules.append(rule)
        return rule

    def count(self, pred: Callable[[Exchange], bool]) -> int:
        with self._lock:
            return sum(1 for e in self.log if pred(e))

    def _pick(self, method: str, path: str, query: dict) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.match(method, path, query):
                    rule.seen += 1
                    if rule.skip < rule.seen <= rule.skip + rule.times:
                        return rule
        return None

    def _record(self, method, path, query, status, key) -> None:
        with self._lock:
            self.log.append(Exchange(method, path, query, status, key))

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def _handle(self):
                parts = urlsplit(self.path)
                query = parse_qs(parts.query, keep_blank_values=True)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                m = _AK_RE.search(self.headers.get("Authorization", ""))
                key = (m.group(1) or m.group(2)) if m else None
                if proxy.allowed_keys is not None and key not in proxy.allowed_keys:
                    extra = f"<AWSAccessKeyId>{key}</AWSAccessKeyId>"
                    self._error(403, "InvalidAccessKeyId",
                                "The AWS Access Key Id you provided does not exist in our records.", extra)
                    proxy._record(self.command, parts.path, query, 403, key)
                    return
                rule = proxy._pick(self.command, parts.path, query)
                if rule is not None and rule.action == "error":
                    self._error(rule.status, rule.code, _MESSAGES.get(rule.code, rule.code))
                    proxy._record(self.command, parts.path, query, rule.status, key)
                    return
                if rule is not None and rule.action == "hang_up":
                    proxy._record(self.command, parts.path, query, -1, key)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, headers, data = self._forward(body)
                proxy._record(self.command, parts.path, query, status if rule is None else -1, key)
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                declared = dict((k.lower(), v) for k, v in headers).get("content-length", str(len(data)))
                self.send_header("Content-Length", declared if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if rule is not None:  # drop: half the body, then the connection goes away
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data)

            def _forward(self, body: bytes):
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST")
                                 else None, headers=headers)
                    resp = conn.getresponse()
                    return resp.status, resp.getheaders(), resp.read()
                finally:
                    conn.close()

            def _error(self, status: int, code: str, message: str, extra: str = ""):
                payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                           f"<Message>{message}</Message>{extra}<RequestId>FAULTPROXY</RequestId>"
                           f"<HostId>fault-proxy</HostId></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
