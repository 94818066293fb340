"""A caller protocol's run on an upstream that speaks it (design §14, native first): the
headers the request carries and the reply on its way back, shaped by `adapters.native`
(the caller's alias, the usage read from the few events that carry it). What differs
between protocols is their `NativeForm`; nothing here names one."""

from __future__ import annotations

from contextlib import aclosing
from typing import Final

import httpcore2

from iop_node.adapters import native
from iop_node.adapters.base import AdapterError, EmitEvents, RunResult
from iop_node.adapters.sse import SSEDecoder, SSEError
from iop_node.adapters.upstream_http.exchange import (
    CORE_ERRORS,
    DONE,
    Progress,
    body_chunks,
    drain,
)
from iop_node.adapters.upstream_http.failures import stream_cut
from iop_node.protocols.native import NativeForm
from schemas.wire import FailureCode, Run

__all__ = ["OWN_HEADERS", "caller_header_pairs", "caller_headers", "relay_native_stream", "shaped"]

#: Headers the adapter owns: a caller's header of these names is never passed on.
OWN_HEADERS: Final = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "accept",
        "accept-encoding",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "authorization",
        "x-api-key",
        "user-agent",
        "proxy-authorization",
        "traceparent",
        "tracestate",
    }
)


def caller_headers(run: Run, form: NativeForm) -> dict[str, str]:
    """The caller's protocol headers a native upstream sees (never one the adapter owns),
    with those the protocol requires (`form.headers`) where the caller sent none."""
    headers = {
        name: value for name, value in run.caller_headers.items() if name.lower() not in OWN_HEADERS
    }
    if form.headers:
        sent = {name.lower() for name in headers}
        for name, value in form.headers.items():
            if name not in sent:
                headers[name] = value
    return headers


def caller_header_pairs(run: Run, form: NativeForm) -> list[tuple[bytes, bytes]]:
    return [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in caller_headers(run, form).items()
    ]


def shaped(reply: native.NativeReply, body: bytes) -> RunResult:
    """A native non-stream body, shaped for its caller."""
    try:
        response = reply.response(body)
    except native.NotAnObject as exc:
        raise AdapterError(
            FailureCode.UPSTREAM_ERROR,
            f"bad upstream output: {exc}",
            retryable=True,
            reply_fault=True,
        ) from None
    except native.InBandError as exc:
        raise AdapterError(
            FailureCode.UPSTREAM_ERROR, f"upstream returned an error: {exc}", retryable=True
        ) from None
    return RunResult(usage=reply.usage, response=response)


async def relay_native_stream(
    response: httpcore2.Response,
    reply: native.NativeReply,
    events: EmitEvents,
    progress: Progress,
) -> RunResult:
    """Relay a native stream: what one upstream read completed leaves as one piece;
    the last events, when the run holds them back, leave with its end (`native`,
    Rule 6), or, when the stream breaks off, ahead of the failure, as they came."""
    try:
        result = await _relay_native_events(response, reply, events, progress)
        if result is None:
            raise stream_cut(
                progress.emitted, "upstream stream ended before its last event", reply_fault=True
            )
    except (*CORE_ERRORS, SSEError, AdapterError):
        if held := reply.release():
            await events(held, 0)
        raise
    return result


async def _relay_native_events(
    response: httpcore2.Response,
    reply: native.NativeReply,
    events: EmitEvents,
    progress: Progress,
) -> RunResult | None:
    """`relay_native_stream`'s loop; None when the body ended before the last event."""
    decoder = SSEDecoder()
    async with aclosing(body_chunks(response)) as body:
        async for raw in body:
            framed: list[bytes] = []
            output = 0
            failure: str | None = None
            malformed = False
            for event in decoder.feed(raw):
                progress.saw_first_byte()
                data = event.data
                if not data.strip() or data == DONE:
                    continue
                try:
                    shaped_event, tokens = reply.event(event.event, data)
                except native.NotAnObject as exc:
                    failure, malformed = f"bad upstream output: {exc}", True
                    break
                except native.InBandError as exc:
                    failure = f"upstream reported an error: {exc}"
                    break
                if shaped_event:
                    framed.append(shaped_event)
                output += tokens
                if reply.ended:
                    break
            if framed:
                await events(framed[0] if len(framed) == 1 else b"".join(framed), output)
                progress.emitted += len(framed)
            if failure is not None:
                # The events before the error went out; the failure names the error.
                raise stream_cut(progress.emitted, failure, reply_fault=malformed)
            if reply.ended:
                await drain(body)
                return RunResult(
                    usage=reply.usage,
                    response=reply.final_response,
                    tail=reply.release() or None,
                )
    return None
