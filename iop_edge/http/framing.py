"""Strict HTTP/1.1 request framing: one reading of where a request ends, or a refusal.

A request whose length two parsers could read two ways is how requests are smuggled past
a proxy in front of the Edge (RFC 9112 §11.2): the proxy reads one request where the Edge
reads two, and the second one is answered as if the proxy had checked it. h11 already
refuses most ambiguous framing (differing Content-Length values, transfer codings other
than chunked); the rules below add what h11 accepts. Each refusal is a 400, and the
connection closes after it: nothing after the refused request is read.

Rule 1: a request with both Content-Length and Transfer-Encoding is refused (RFC 9112
        §6.3: "ought to be handled as an error"); h11 would read it by its chunks.
Rule 2: an HTTP/1.0 request with Transfer-Encoding is refused (RFC 9112 §6.1: its framing
        is faulty, whatever Content-Length says).
Rule 3: a header continued on the next line (obsolete line folding, RFC 9112 §5.2) is
        refused; h11 would join the lines, as some proxies do and others do not.
Rule 4: every framing error (these, h11's, a 431 for a head past the size limit, a 501
        for a transfer coding h11 does not implement) is answered with OpenAI's error
        body and `Connection: close`, as every other error of the Edge is.
Rule 5: a head larger than the limit (Hypercorn's `h11_max_incomplete_size`) is refused
        with 431 however it arrived; h11 checks the limit only while a head is
        incomplete, so one that came in a single read up to 64 KiB passed.
Rule 6: HTTP/1.1 only. HTTP/2 with prior knowledge (its `PRI * HTTP/2.0` preface) is
        refused with 505, and an `Upgrade: h2c` is ignored (RFC 9110 §7.8 lets a server):
        the Edge's connections, their writes and their bounds are HTTP/1.1's, and TLS
        and HTTP/2 end at a proxy in front of it (docs/http-api.md).

`StrictH11Protocol` is Hypercorn's HTTP/1.1 protocol with `StrictRequestReader` as its
h11 connection and `send_error_response` answering with a body (Rule 4): the only
method of Hypercorn's it replaces (its `_send_error_response`, behind the hook of
`iop_edge.http.compat.hypercorn`), pinned by `tests/hostile/test_http_framing.py`.
"""

from __future__ import annotations

import re
from itertools import chain
from typing import Any, Final

import h11

from iop_edge.http.compat.hypercorn import Http11Protocol
from iop_edge.http.errors import ApiError
from iop_edge.http.request_ids import new_run_id

__all__ = ["StrictH11Protocol", "StrictRequestReader", "framing_error", "framing_problem"]

#: Where a request's head ends, as h11 finds it (a bare LF ends a line too).
_END_OF_HEAD: Final = re.compile(rb"\n\r?\n")
#: A line of the head after the first that begins with a space or a tab: folded.
_FOLDED_LINE: Final = re.compile(rb"\n[ \t]")
#: The HTTP versions served (Rule 6).
_HTTP1: Final = frozenset((b"1.0", b"1.1"))


def framing_problem(request: h11.Request, head: bytes) -> str | None:
    """What makes `request` ambiguous to frame (Rules 1-3), or None when nothing does.

    `head` is the received bytes the request was parsed from (its head, and maybe more)."""
    names = {name for name, _ in request.headers}  # h11 gives names in lower case
    if b"transfer-encoding" in names:
        if b"content-length" in names:
            return (
                "the request has both Content-Length and Transfer-Encoding, so its end is "
                "ambiguous (RFC 9112 §6.3); send one of them"
            )
        if request.http_version == b"1.0":
            return "Transfer-Encoding is not part of HTTP/1.0 (RFC 9112 §6.1)"
    end = _END_OF_HEAD.search(head)
    if _FOLDED_LINE.search(head, 0, end.start() if end else len(head)):
        return (
            "a header line continues on the next line (obsolete line folding, RFC 9112 "
            "§5.2); send each header on one line"
        )
    return None


class StrictRequestReader(h11.Connection):
    """h11's server connection, refusing the requests `framing_problem` finds ambiguous.

    The refusal is raised as h11 raises its own (`RemoteProtocolError`, a 400 hint), and
    again on every later call: the connection is done. `refusal` keeps the reason of the
    last error raised, h11's own included, for the error body (Rule 4)."""

    def __init__(self, our_role: type[h11.SERVER], *, max_incomplete_event_size: int) -> None:
        super().__init__(our_role, max_incomplete_event_size=max_incomplete_event_size)
        self._max_head_bytes = max_incomplete_event_size
        self.refusal: str | None = None

    def next_event(self) -> Any:
        if self.refusal is not None:
            raise h11.RemoteProtocolError(self.refusal, error_status_hint=400)
        # The head is parsed from the buffer's start; only a request's head is checked.
        head = self.trailing_data[0] if self.their_state is h11.IDLE else None
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = str(exc)
            raise
        if head is not None and isinstance(event, h11.Request):
            if event.http_version not in _HTTP1:  # Rule 6
                self.refusal = (
                    f"HTTP/{event.http_version.decode('ascii', 'replace')} is not served "
                    "here: send HTTP/1.1"
                )
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=505)
            end = _END_OF_HEAD.search(head)
            if end is not None and end.end() > self._max_head_bytes:  # Rule 5
                self.refusal = "the request's head is too large"
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=431)
            problem = framing_problem(event, head)
            if problem is not None:
                self.refusal = problem
                raise h11.RemoteProtocolError(problem, error_status_hint=400)
        return event


def framing_error(status: int, reason: str | None, max_head_bytes: int) -> ApiError:
    """The error a framing failure with `status` (h11's hint) is answered with."""
    detail = f": {reason}" if reason else ""
    if status == 431:
        return ApiError(
            431,
            f"The request's header fields are too large (over {max_head_bytes} bytes)",
            code="request_headers_too_large",
        )
    if status == 501:
        return ApiError(
            501,
            f"Unsupported transfer coding{detail}",
            code="unsupported_transfer_coding",
        )
    if status == 505:
        return ApiError(505, f"HTTP version not supported{detail}", code="http_version")
    return ApiError(status, f"Malformed HTTP request{detail}", code="malformed_request")


class StrictH11Protocol(Http11Protocol):
    """Hypercorn's HTTP/1.1 protocol with strict framing (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = StrictRequestReader(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    async def check_protocol(self, request: h11.Request) -> None:
        """Rule 6: no switch to HTTP/2; an `Upgrade: h2c` is served as HTTP/1.1."""

    async def send_error_response(self, status_code: int) -> None:
        """Hypercorn's answer to a request h11 (or Rules 1-3, 5, 6) refused, with a body."""
        reason = getattr(self.connection, "refusal", None)
        error = framing_error(status_code, reason, self.config.h11_max_incomplete_size)
        body = error.body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
            (b"x-request-id", new_run_id().encode()),
        ]
        response = h11.Response(
            status_code=status_code,
            headers=list(chain(headers, self.config.response_headers("h11"))),
        )
        await self.send_h11_event(response)
        await self.send_h11_event(h11.Data(data=body))
        await self.send_h11_event(h11.EndOfMessage())
