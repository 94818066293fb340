"""A byte-level Server-Sent Events decoder: feed it what the socket gave, get whole events.

OpenAI-compatible upstreams stream `data: {json}` events separated by blank lines and end
with `data: [DONE]`. The adapter must relay each event's JSON *exactly as the upstream
wrote it* (provider fields, key order and number formatting included), so this decoder
works on bytes and never decodes the payload: an event's `data` is the very bytes that
followed `data:` on the wire.

Rules (from the WHATWG "event stream interpretation" algorithm, trimmed to what we use):

1. A line ends at CRLF, LF or CR. A CR that ends one `feed()` and an LF that starts the
   next are one line ending, not two.
2. An empty line dispatches the event being built; an event with no `data` line is
   dropped, as the standard says.
3. `data:` lines accumulate; several are joined with LF. One space after the colon is
   removed. `event:` names the event (default "message"). Lines starting with `:` are
   comments (keep-alives). `id:`, `retry:` and unknown fields are ignored.
4. Bytes after the last complete event stay buffered until more arrive; at end of stream
   an unterminated event is discarded (`pending()` tells the caller it existed).
5. An event (or a line without an ending) larger than `max_event_bytes` raises
   `SSEError`, so a broken upstream cannot grow our memory without bound.

Pure state machine, no I/O, so it is tested synchronously.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Large enough for a chunk with long tool-call arguments or top-k logprobs.
DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEError(ValueError):
    """The byte stream is not a sane event stream (today: an event over the size bound)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: bytes
    event: str = "message"


class SSEDecoder:
    """Incremental SSE decoder; see the module docstring for the rules it follows."""

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._skip_lf = False  # rule 1: the previous feed ended with a bare CR
        self._data: list[bytes] = []
        self._event = ""
        self._event_bytes = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk`; return the events it completed, in order."""
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buffer = self._buffer
        buffer += chunk
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(buffer):
            event = self._line(bytes(buffer[start : match.start()]))
            if event is not None:
                events.append(event)
            start = match.end()
            if match.group() == b"\r" and start == len(buffer):
                self._skip_lf = True
        del buffer[:start]
        if self._event_bytes + len(buffer) > self._max_event_bytes:
            raise SSEError(f"server-sent event larger than {self._max_event_bytes} bytes")
        return events

    def pending(self) -> bool:
        """True if bytes of an event not yet terminated by a blank line are buffered."""
        return bool(self._buffer or self._data or self._event)

    def _line(self, line: bytes) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line[:1] == b":":
            return None
        self._event_bytes += len(line)
        if self._event_bytes > self._max_event_bytes:
            raise SSEError(f"server-sent event larger than {self._max_event_bytes} bytes")
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value.decode("utf-8", errors="replace")
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event, self._event_bytes = [], "", 0
        if not data:
            return None
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        return SSEEvent(data=payload, event=event or "message")
