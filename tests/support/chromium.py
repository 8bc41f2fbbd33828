"""Headless Chromium (Debian's `chromium`, scripts/ci-system-deps-chromium) driven over the DevTools protocol:
open a page, wait until a JavaScript expression says it has rendered, read values from the DOM, screenshot it."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect


class Page:
    """One browser tab, spoken to over its DevTools websocket."""

    def __init__(self, websocket_url: str):
        self.ws = connect(websocket_url, max_size=64 * 2**20)
        self.ids = itertools.count(1)
        self.errors: list[str] = []  # the page's uncaught exceptions and error-level log entries, for failures
        self.call("Runtime.enable")
        self.call("Log.enable")

    def call(self, method: str, **params: Any) -> dict:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            message = json.loads(self.ws.recv(timeout=120))
            self._keep_error(message)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def _keep_error(self, message: dict) -> None:
        params = message.get("params", {})
        if message.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif message.get("method") == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"{params['entry']['text']} {params['entry'].get('url', '')}")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, ready: str, until: Callable[[Any], bool], timeout: float = 180) -> Any:
        """Navigate to `url` and poll the expression `ready` until `until(value)`; returns that value. A timeout
        says what the tab shows and the errors the page logged."""
        self.call("Page.navigate", url=url)
        deadline, value = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            value = self.evaluate(ready)
            if until(value):
                return value
            time.sleep(1)
        shown = self.evaluate("[location.href, document.title, (document.body?.innerText ?? '').slice(0, 800)]")
        raise TimeoutError(f"{url} did not render within {timeout:.0f} s: {ready} = {value!r}; "
                           f"the tab shows {shown!r}; the page's errors: {self.errors[-10:]!r}")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


@contextmanager
def chromium_page(profile_dir: Path, width: int = 1400, height: int = 2000) -> Iterator[Page]:
    """A headless Chromium with its own profile, and its first tab."""
    binary = shutil.which("chromium")
    assert binary, "chromium is not installed: run scripts/ci-system-deps-chromium"
    proc = subprocess.Popen(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--remote-debugging-port=0", f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        port = None
        for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/…"
            if found := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                port = int(found.group(1))
                break
        assert port, "chromium exited before it opened its DevTools port"
        [tab] = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=30).json() if t["type"] == "page"]
        page = Page(tab["webSocketDebuggerUrl"])
        try:
            yield page
        finally:
            page.ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
