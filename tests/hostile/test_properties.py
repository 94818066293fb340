"""Property-based: whatever arrives, the config loader, the wire decoders and the request
parser answer with their own errors, never a crash or a 500.

Examples are bounded so the suite stays fast in CI; every case hypothesis ever found is
kept in the `@example`s below as a regression."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import trio
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from iop_edge.core.configuration.config import ConfigInvalid, parse_config
from iop_edge.core.snapshot import Snapshot
from iop_edge.http.protocols.protocol_registry import PROTOCOLS
from iop_edge.http.protocols.responses import ResponsesSurface
from iop_edge.http.runs import RunEndpoints
from iop_edge.runtime.metering.metering import Metering
from iop_edge.runtime.metering.metrics import EdgeMetrics
from iop_edge.runtime.metering.response_store import ResponseStore, SqliteResponses
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas import wire
from schemas.config import ResponsesSection
from tests.nodeless_pool import nodeless_dispatcher
from tests.unit.test_config import valid

FAST = settings(
    max_examples=150,
    deadline=None,  # the machine's speed drifts; the examples are small
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # the same examples in CI as here
    database=None,  # nothing written into the work tree
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


# --- the config loader ------------------------------------------------------------------


def _loads_or_refuses(text: str) -> None:
    try:
        parse_config(text)
    except ConfigInvalid as invalid:
        assert invalid.errors and all(isinstance(e.message, str) for e in invalid.errors)


@FAST
@given(st.text(max_size=300))
@example("k: " + "[" * 1000)
@example("a: &a [*a]")
@example('edge: {state_dir: "\\0"}')
@example("? [a]\n: b")
@example("!!python/object:os.system {}")
def test_any_text_loads_or_is_refused_with_errors(text: str) -> None:
    _loads_or_refuses(text)


def _with_leaf_replaced(raw: Any, path: list[int], value: Any) -> Any:
    """`raw` with the leaf found by walking `path` (indexes modulo each level's size)
    replaced by `value`."""
    if not path or not isinstance(raw, dict | list) or not raw:
        return value
    if isinstance(raw, dict):
        key = list(raw)[path[0] % len(raw)]
        return {**raw, key: _with_leaf_replaced(raw[key], path[1:], value)}
    index = path[0] % len(raw)
    return [*raw[:index], _with_leaf_replaced(raw[index], path[1:], value), *raw[index + 1 :]]


@FAST
@given(st.lists(st.integers(min_value=0, max_value=50), max_size=6), json_values)
def test_a_valid_config_with_any_value_anywhere_loads_or_is_refused(
    path: list[int], value: Any
) -> None:
    _loads_or_refuses(yaml.safe_dump(_with_leaf_replaced(valid(), path, value)))


# --- the wire decoders ------------------------------------------------------------------

msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
message_like = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            [
                "hello",
                "run_chunk",
                "run_done",
                "run_failed",
                "status",
                "refresh_ack",
                "reject",
                "run",
                "welcome",
                "nope",
            ]
        )
    },
    optional={
        "run_id": msgpack_values,
        "usage": msgpack_values,
        "code": st.sampled_from([*wire.FailureCode, "bogus"]) | msgpack_values,
        "providers": msgpack_values,
        "data": msgpack_values,
        "protocol": msgpack_values,
    },
)


def _decodes_or_wire_error(frame: bytes) -> None:
    for decode in (wire.decode_from_node, wire.decode_from_edge):
        try:
            decode(frame)
        except wire.WireError:
            pass


@FAST
@given(st.binary(max_size=200))
@example(b"\x91" * 60_000 + b"\xc0")
@example(b"\xdd\xff\xff\xff\xff")
def test_any_bytes_decode_or_are_a_wire_error(frame: bytes) -> None:
    _decodes_or_wire_error(frame)


@FAST
@given(message_like)
def test_any_message_shaped_frame_decodes_or_is_a_wire_error(message: dict[str, Any]) -> None:
    _decodes_or_wire_error(msgspec.msgpack.encode(message))


# --- the request parser -----------------------------------------------------------------

_SNAPSHOT = Snapshot.build(parse_config(yaml.safe_dump(valid())).config, revision=1,
                           config_sha256="0" * 64)  # fmt: skip


def _endpoints() -> RunEndpoints:
    """The run endpoints over a pool with no node connected: whatever a request is, it
    ends at parsing (4xx) or at admission (503), in process, with no sockets."""
    scheduler = Scheduler(_SNAPSHOT)
    metering = Metering(EdgeMetrics(scheduler.catalog), UsageLedger(_NOWHERE))
    dispatcher = nodeless_dispatcher(scheduler, meter=metering.record)
    responses = ResponsesSurface(ResponseStore(SqliteResponses(_NOWHERE), ResponsesSection()))
    return RunEndpoints(lambda: _SNAPSHOT, dispatcher, metering, responses)


_NOWHERE = Path("/nonexistent-iop-test/usage.sqlite3")  # never opened: nothing is billed


def _status_of(path: str, body: bytes) -> int:
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}

    async def call() -> None:
        route = PROTOCOLS.route(path)
        assert route is not None
        await _endpoints()(route, scope, receive, send)  # type: ignore[arg-type]

    trio.run(call)
    assert sent and sent[0]["type"] == "http.response.start"
    assert not sent[-1].get("more_body", False)
    return int(sent[0]["status"])


request_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m1", "nope", ""]) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]) | json_values},
                optional={"content": json_values},
            ),
            max_size=3,
        )
        | json_values,
        "prompt": json_values,
        "input": json_values,
        "stream": json_values,
        "stream_options": json_values,
        "max_tokens": json_values | st.integers(),
        "max_completion_tokens": json_values,
        "n": json_values | st.integers(),
    },
)


@FAST
@given(st.sampled_from(sorted(PROTOCOLS.paths())), request_bodies)
@example("/v1/chat/completions", {"model": "m1", "messages": [{"role": "user"}], "n": 10**30})
def test_any_request_body_is_answered_below_500(path: str, body: dict[str, Any]) -> None:
    status = _status_of(path, msgspec.json.encode(body))
    assert status < 500 or status == 503, (status, body)


@FAST
@given(st.sampled_from(sorted(PROTOCOLS.paths())), st.binary(max_size=200))
@example("/v1/chat/completions", b"[" * 100_000)
@example("/v1/chat/completions", b'{"model": "m1", "messages": [], "max_tokens": 1e999}')
def test_any_bytes_are_answered_below_500(path: str, body: bytes) -> None:
    status = _status_of(path, body)
    assert status < 500 or status == 503, (status, body)


def test_the_parser_harness_reaches_admission() -> None:
    """A sound request gets past parsing to admission (503: no node), so the properties
    above exercise the whole request path, not only its refusals."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    assert _status_of("/v1/chat/completions", msgspec.json.encode(body)) == 503
    assert _status_of("/v1/chat/completions", b"{}") == 400
