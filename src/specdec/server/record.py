"""`specdec serve --record-requests FILE`: the prompts the server was asked, kept for training a
head on them (`specdec train --requests FILE`, train/conversations.read_requests).

A head learns the answers to what it is asked, and nothing teaches it the server's traffic as well
as that traffic (docs/results/heads.md). Each request the engine admits is appended as one JSON line in a form
read_requests takes: a chat request's messages as {"messages": [...]} (roles as the server read
them), a text completion as {"prompt": ...} (a prompt of token ids has no text to ask again, and is
left out). One write() a line on a descriptor opened for appending, so a line is whole or absent;
a line a full disk cut short is cut off again. The file holds what the users wrote: keep it as
private as that.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..errors import SpecdecError
from ..paths import reason

log = logging.getLogger("specdec.server")


class RequestLog:
    """Appends each request's prompt to `path` (created with mode 0600 where it is missing)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise SpecdecError(f"--record-requests {self.path} cannot be written: {reason(exc)}") from None
        self.lines = 0  # written by this process
        self._warned = False

    def add(self, messages: list[dict] | None, prompt) -> None:
        """One request: its chat messages, or its text prompt; a prompt of token ids is skipped."""
        if messages is not None:
            entry = {"messages": messages}
        elif isinstance(prompt, str):
            entry = {"prompt": prompt}
        else:
            return
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
        size = None
        try:
            size = os.fstat(self._fd).st_size
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"wrote {written} of {len(line)} bytes")
            self.lines += 1
        except OSError as exc:  # a full disk: the request is served all the same, the line dropped
            if size is not None:
                try:
                    os.ftruncate(self._fd, size)  # no half line for read_requests to stop at
                except OSError:
                    pass
            if not self._warned:
                self._warned = True
                log.warning("--record-requests %s: a request was not recorded (%s)", self.path, reason(exc))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
