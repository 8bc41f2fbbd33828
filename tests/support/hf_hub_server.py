"""A small local server speaking the part of the Hugging Face Hub HTTP API that ``snapshot_download`` uses.

Endpoints (models and datasets; ``{type}`` is ``models`` or ``datasets``):

- ``GET /api/{type}/{org}/{name}[/revision/{rev}]``: repo info with the resolved commit ``sha`` and
  ``siblings``;
- ``GET /api/{type}/{org}/{name}/tree/{rev}[/{path}]?recursive=...``: the file listing (path, size, git
  blob ``oid``);
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}`` (``/datasets/...`` for datasets): the file, with
  ``X-Repo-Commit``, ``ETag`` (the blob oid) and ``Content-Length``; ``Range`` is honoured.

Errors carry the ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) that
huggingface_hub turns into its typed exceptions. Repos are in memory; each ``add_revision`` makes a commit.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from tests.support.http_server import BackgroundHTTPServer

_API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?$")
_RESOLVE = re.compile(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def resolve(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


class HfHubServer(BackgroundHTTPServer):
    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        super().__init__(self._handler_class())

    def add_revision(self, repo_type: str, repo_id: str, files: dict[str, bytes], branch: str = "main",
                     tags: tuple[str, ...] = ()) -> str:
        """Commit ``files`` as the new head of ``branch``; returns the 40-hex commit sha."""
        repo = self.repos.setdefault((repo_type, repo_id), Repo())
        h = hashlib.sha1(repo_id.encode() + str(len(repo.commits)).encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + files[path])
        sha = h.hexdigest()
        repo.commits[sha] = dict(files)
        for ref in (branch, *tags):
            repo.refs[ref] = sha
        return sha

    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, value, status: int = 200):
                self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json"})

            def _missing(self, code: str, message: str):
                self._send(404, json.dumps({"error": message}).encode(),
                           {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message})

            def _lookup(self, repo_type: str, repo_id: str, rev: str):
                repo = hub.repos.get((repo_type, repo_id))
                if repo is None:
                    self._missing("RepoNotFound", f"Repository {repo_id} not found")
                    return None, None
                sha = repo.resolve(unquote(rev))
                if sha is None:
                    self._missing("RevisionNotFound", f"Invalid rev id: {rev}")
                    return None, None
                return sha, repo.commits[sha]

            def do_GET(self):
                path = urlsplit(self.path).path
                with hub._lock:
                    hub.requests.append((self.command, path))
                if m := _API.match(path):
                    kind, repo_id, what, rev, sub = m.groups()
                    what, rev = what or "revision", rev or "main"
                    sha, files = self._lookup(kind[:-1], repo_id, rev)
                    if sha is None:
                        return
                    if what == "revision":
                        return self._json({"id": repo_id, "sha": sha, "private": False,
                                           "siblings": [{"rfilename": p} for p in sorted(files)]})
                    sub = unquote(sub or "").strip("/")
                    return self._json([{"type": "file", "path": p, "size": len(d), "oid": git_blob_oid(d)}
                                       for p, d in sorted(files.items()) if not sub or p.startswith(sub + "/")])
                if m := _RESOLVE.match(path):
                    is_dataset, repo_id, rev, file_path = m.groups()
                    sha, files = self._lookup("dataset" if is_dataset else "model", repo_id, rev)
                    if sha is None:
                        return
                    data = files.get(unquote(file_path))
                    if data is None:
                        return self._missing("EntryNotFound", f"{file_path} does not exist at {rev}")
                    headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_oid(data)}"',
                               "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
                    rng = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                    if rng:
                        start = int(rng.group(1))
                        end = int(rng.group(2)) if rng.group(2) else len(data) - 1
                        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                        return self._send(206, data[start:end + 1], headers)
                    return self._send(200, data, headers)
                self._missing("NotFound", f"no route for {path}")

            do_HEAD = do_GET

        return Handler
