"""Turn repeated ModelArts log previews into a stream of new lines, each emitted once.

The preview API returns the *tail* of a task's log: ``content`` (at most a few MB), ``current_size`` (its
length in bytes) and ``full_size`` (the whole log's length in bytes). So the content covers bytes
``[full_size - current_size, full_size)`` of the log. ``LogTail`` remembers how many bytes of the log it
has emitted and, for each new preview, emits only the bytes after that point, one line at a time.

Invariants: every byte is emitted at most once; a trailing partial line is held back until its newline
arrives (or the job ended: ``final=True``); when the log grew by more than one preview window between two
polls, a single marker line states how many bytes were skipped, instead of silently losing them.
"""

from __future__ import annotations


class LogTail:
    def __init__(self) -> None:
        self.emitted = 0  # bytes of the log already emitted (or skipped with a marker)
        self._partial = b""

    def feed(self, content: str, current_size: int, full_size: int, *, final: bool = False) -> list[str]:
        data = content.encode("utf-8")
        # Trust the bytes we got over the sizes when they disagree (e.g. a server counting characters).
        start = max(full_size - len(data), 0) if full_size else 0
        end = start + len(data)
        lines: list[str] = []
        if end < self.emitted:  # the log was replaced (task restarted): start over
            self.emitted, self._partial = 0, b""
        if start > self.emitted:
            if self._partial:  # what we had of the cut line is still worth showing
                lines.append(self._partial.decode("utf-8", errors="replace"))
            lines.append(f"[... {start - self.emitted} bytes of log not shown: the preview only keeps the tail ...]")
            self.emitted, self._partial = start, b""
        new = self._partial + data[self.emitted - start:]
        self.emitted = end
        *complete, self._partial = new.split(b"\n")
        if final and self._partial:
            complete.append(self._partial)
            self._partial = b""
        lines.extend(line.decode("utf-8", errors="replace").rstrip("\r") for line in complete)
        return lines
