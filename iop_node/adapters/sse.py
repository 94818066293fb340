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
6. One UTF-8 byte order mark at the very start of the stream is dropped (else the first
   line would be a field named `\ufeffdata`, and its event lost).

Pure state machine, no I/O, so it is tested synchronously.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Large enough for a chunk with long tool-call arguments or top-k logprobs.
DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


class SSEError(ValueError):
    """The byte stream is not a sane event stream (today: an event over the size bound)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: bytes
    event: str = "message"


class SSEDecoder:
    """Incremental SSE decoder; see the module docstring for the rules it follows.

    Each `feed` scans only the bytes it is given: a line that spans several feeds is kept
    as a list of pieces and joined once its ending arrives, so an event that trickles in
    over many reads costs time linear in its size. The common case, one whole event per
    read with LF endings (what an HTTP chunk of an OpenAI stream holds), is one
    `bytes.split` and one slice per `data:` line."""

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max_event_bytes = max_event_bytes
        self._partial: list[bytes] = []  # the start of a line that has no ending yet
        self._partial_bytes = 0
        self._skip_lf = False  # rule 1: the previous feed ended with a bare CR
        self._data: list[bytes] = []
        self._event = ""
        self._event_bytes = 0
        self._head: bytes | None = b""  # rule 6: the stream's first bytes, until known

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume `chunk`; return the events it completed, in order."""
        if self._head is not None:
            chunk = self._head + chunk
            if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                self._head = chunk  # the start of a BOM, or not: the next feed says
                return []
            self._head = None
            if chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            *lines, tail = _LINE_END.split(chunk)
            self._skip_lf = chunk.endswith(b"\r")
        else:
            *lines, tail = chunk.split(b"\n")
        events: list[SSEEvent] = []
        if lines:
            if self._partial:
                lines[0] = b"".join((*self._partial, lines[0]))
                self._partial = []
                self._partial_bytes = 0
            for line in lines:
                event = self._line(line)
                if event is not None:
                    events.append(event)
        if tail:
            self._partial.append(tail)
            self._partial_bytes += len(tail)
        if self._event_bytes + self._partial_bytes > self._max_event_bytes:
            raise SSEError(f"server-sent event larger than {self._max_event_bytes} bytes")
        return events

    def pending(self) -> bool:
        """True if bytes of an event not yet terminated by a blank line are buffered."""
        return bool(self._partial or self._data or self._event)

    def _line(self, line: bytes) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line[:1] == b":":
            return None
        self._event_bytes += len(line)
        if self._event_bytes > self._max_event_bytes:
            raise SSEError(f"server-sent event larger than {self._max_event_bytes} bytes")
        if line.startswith(b"data:"):  # nearly every line: slice the value out directly
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            return None
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":  # a bare `data` line: an empty value
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
