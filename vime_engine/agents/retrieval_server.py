"""A tiny retrieval server for the search agents (search_generate.py, openai_search_agent.py): the standard
library's HTTP server over a small in-memory corpus, ranking passages by the words they share with the query; and
what its clients share (where it is, the query tag, how passages read).

It stands in for a real retriever (vime's search-r1 example runs a dense index behind the same kind of endpoint)
so the agent can be tried and tested on one machine with nothing to download: `POST /retrieve` with
`{"query": "...", "topk": 3}` answers `{"passages": [{"title": ..., "text": ..., "score": ...}, ...]}`, best first,
passages sharing no word with the query left out. `python -m vime_engine.agents.retrieval_server --port 8000`
serves the built-in corpus; tests start one in a thread with `start_retrieval_server()` on a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vime_engine.rewards.server import send_json

ROUTE = "/retrieve"
DEFAULT_TOPK = 3
SEARCH_URL_KEY = "search_url"  # a sample's metadata key naming the server
SEARCH_URL_ENV = "VIMEFLOW_SEARCH_URL"  # else this environment variable
SEARCH_TAG = re.compile(r"<search>(.*?)</search>", re.DOTALL)  # how the model may steer the query
_WORD = re.compile(r"[a-z0-9]+")
# Words too common to say what a passage is about; they would rank every passage alike.
_STOPWORDS = frozenset("a an and are as at be by for from has he in is it its of on or she that the to was were "
                       "what when where which who whom why with how does did do".split())


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


CORPUS = (
    Passage("Paris", "Paris is the capital and largest city of France, on the river Seine."),
    Passage("Berlin", "Berlin is the capital of Germany and its largest city by population."),
    Passage("Mount Everest", "Mount Everest, in the Himalayas, is the highest mountain above sea level: 8,849 m."),
    Passage("Python", "Python is a programming language created by Guido van Rossum, first released in 1991."),
    Passage("Water", "Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees Celsius."),
    Passage("Moon", "The Moon is Earth's only natural satellite; Neil Armstrong first walked on it in 1969."),
)


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower())) - _STOPWORDS


def retrieve(corpus: Sequence[Passage], query: str, topk: int = DEFAULT_TOPK) -> list[dict[str, object]]:
    """The `topk` passages sharing the most words with `query` (title and text), ties in corpus order."""
    wanted = words(query)
    scored = [(len(wanted & words(f"{p.title} {p.text}")), i, p) for i, p in enumerate(corpus)]
    ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))[:max(0, topk)]
    return [{"title": p.title, "text": p.text, "score": score} for score, _, p in ranked]


class RetrievalServer(ThreadingHTTPServer):
    """Serves `POST /retrieve` over `corpus`; `url` is where to post, `close()` stops it."""

    daemon_threads = True

    def __init__(self, corpus: Sequence[Passage], host: str = "127.0.0.1", port: int = 0):
        super().__init__((host, port), _Handler)
        self.corpus = tuple(corpus)
        self.url = f"http://{host}:{self.server_address[1]}{ROUTE}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: RetrievalServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path != ROUTE:
            return self._answer(404, {"error": f"no route {self.path}; POST {ROUTE}"})
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            query, topk = str(request["query"]), int(request.get("topk", DEFAULT_TOPK))
        except (ValueError, KeyError, TypeError) as exc:
            return self._answer(400, {"error": f"expected {{\"query\": str, \"topk\": int}}: {exc!r}"})
        self._answer(200, {"passages": retrieve(self.server.corpus, query, topk)})

    def _answer(self, status: int, body: dict[str, object]) -> None:
        send_json(self, status, body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a rollout queries it once per search."""


def search_url(sample: Any) -> str:
    """The retrieval server an agent's sample uses: `metadata[SEARCH_URL_KEY]`, else SEARCH_URL_ENV."""
    url = sample.metadata.get(SEARCH_URL_KEY) or os.environ.get(SEARCH_URL_ENV)
    if not url:
        raise ValueError(f"no retrieval server for the search agent: set the sample's metadata[{SEARCH_URL_KEY!r}] or "
                         f"{SEARCH_URL_ENV} (python -m vime_engine.agents.retrieval_server serves a small corpus)")
    return url


def information(passages: list[dict[str, Any]]) -> str:
    """The passages as the model reads them after its search."""
    docs = "\n".join(f"Doc {i}(Title: {p['title']}) {p['text']}" for i, p in enumerate(passages, 1))
    return f"\n\n<information>{docs or 'No passage matches the query.'}</information>\n\n"


def start_retrieval_server(corpus: Sequence[Passage] = CORPUS, host: str = "127.0.0.1",
                           port: int = 0) -> RetrievalServer:
    """A RetrievalServer serving in a daemon thread (port 0: a free one, read back from `url`)."""
    server = RetrievalServer(corpus, host, port)
    threading.Thread(target=server.serve_forever, name="retrieval-server", daemon=True).start()
    return server


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = RetrievalServer(CORPUS, args.host, args.port)
    print(f"serving {len(CORPUS)} passages at {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
