"""The two registries of caller protocols: the Edge's (`CallerProtocol` by path, by name,
by whose client sent a request) and the Node's (`Translator` by a run's operation)."""

from __future__ import annotations

import json

import pytest

from iop_edge.http.errors import ApiError
from iop_edge.http.protocols.chat import CHAT
from iop_edge.http.protocols.messages import MESSAGES
from iop_edge.http.protocols.protocol_registry import PROTOCOLS, Protocols
from iop_edge.http.protocols.responses import RESPONSES
from iop_edge.runtime.runs.limits import RateLimits
from iop_node.runs.protocol_run import TRANSLATORS
from iop_node.runs.protocol_run.messages import MESSAGES as MESSAGES_TRANSLATOR
from iop_node.runs.protocol_run.responses import RESPONSES as RESPONSES_TRANSLATOR


@pytest.mark.parametrize(
    ("path", "protocol", "operation"),
    [
        ("/v1/chat/completions", "chat", "chat"),
        ("/v1/completions", "chat", "completion"),
        ("/v1/embeddings", "chat", "embedding"),
        ("/v1/messages", "messages", "messages"),
        ("/v1/messages/count_tokens", "messages", "count_tokens"),
        ("/v1/responses", "responses", "responses"),
        ("/v1/responses/compact", "responses", "responses"),
    ],
)
def test_every_run_endpoint_routes_to_its_protocol(
    path: str, protocol: str, operation: str
) -> None:
    route = PROTOCOLS.route(path)
    assert route is not None
    assert (route.protocol.name, route.operation) == (protocol, operation)
    assert PROTOCOLS.named(protocol) is route.protocol


def test_a_path_outside_the_run_endpoints_has_no_route() -> None:
    assert PROTOCOLS.route("/v1/models") is None
    assert PROTOCOLS.route("/v1/responses/resp_1") is None


@pytest.mark.parametrize(
    ("path", "headers", "protocol"),
    [
        ("/v1/models", {"anthropic-version"}, MESSAGES),
        ("/v1/messages/batches", set(), MESSAGES),
        ("/v1/models", {"authorization"}, CHAT),
        ("/v1/responses/resp_1", set(), CHAT),
    ],
)
def test_a_request_outside_the_run_endpoints_gets_its_clients_shapes(
    path: str, headers: set[str], protocol: object
) -> None:
    assert PROTOCOLS.of_request(path, headers) is protocol


def test_each_protocol_answers_in_its_own_error_shape() -> None:
    error = ApiError(429, "slow down", code="rate_limit_requests")
    openai = json.loads(CHAT.error_body(error, "req_1"))
    assert openai["error"]["code"] == "rate_limit_requests"
    assert json.loads(RESPONSES.error_body(error, "req_1")) == openai
    anthropic = json.loads(MESSAGES.error_body(error, "req_1"))
    assert anthropic["error"]["type"] == "rate_limit_error"
    assert anthropic["request_id"] == "req_1"


@pytest.mark.parametrize(("wait_s", "header"), [(0.2, "1"), (1.0, "1"), (11.3, "12")])
def test_retry_after_is_never_earlier_than_the_wait(wait_s: float, header: str) -> None:
    """Rounded up: a client that waits as told is not refused again."""
    error = ApiError(429, "slow down", code="rate_limit_requests", retry_after_s=wait_s)
    assert error.headers()["Retry-After"] == header


def test_each_protocol_writes_its_own_rate_limit_headers() -> None:
    limits = RateLimits(limit_requests=2, remaining_requests=1, reset_requests_s=30.0)
    assert {name for name, _ in CHAT.rate_limit_headers(limits)} == {
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
    }
    assert RESPONSES.rate_limit_headers(limits) == CHAT.rate_limit_headers(limits)
    assert {name for name, _ in MESSAGES.rate_limit_headers(limits)} == {
        b"anthropic-ratelimit-requests-limit",
        b"anthropic-ratelimit-requests-remaining",
        b"anthropic-ratelimit-requests-reset",
    }


def test_only_chat_ends_its_streams_with_a_line_of_its_own() -> None:
    assert CHAT.stream_end == b"data: [DONE]\n\n"
    assert MESSAGES.stream_end == RESPONSES.stream_end == b""


def test_a_name_or_a_path_is_served_once() -> None:
    protocols = Protocols((CHAT,), default=CHAT)
    with pytest.raises(ValueError, match="'chat'"):
        protocols.register(CHAT)
    protocols.register(MESSAGES)
    protocols.unregister("messages")
    assert protocols.route("/v1/messages") is None
    assert protocols.route("/v1/chat/completions") is not None


def test_the_node_finds_a_translator_by_operation() -> None:
    assert TRANSLATORS.of("messages") is MESSAGES_TRANSLATOR
    assert TRANSLATORS.of("count_tokens") is MESSAGES_TRANSLATOR
    assert TRANSLATORS.of("responses") is RESPONSES_TRANSLATOR
    for operation in ("chat", "completion", "embedding", "unknown"):
        assert TRANSLATORS.of(operation) is None  # the adapter's, as it is


def test_the_node_refuses_a_translator_for_what_is_served() -> None:
    with pytest.raises(ValueError, match="messages"):
        TRANSLATORS.register(MESSAGES_TRANSLATOR)


def test_a_native_form_says_where_and_how_a_runtime_serves_its_protocol() -> None:
    messages = MESSAGES_TRANSLATOR.native
    responses = RESPONSES_TRANSLATOR.native
    assert messages is not None and responses is not None
    assert (messages.path, responses.path) == ("/messages", "/responses")
    assert messages.key_header == "x-api-key" and responses.key_header is None
    assert "anthropic-version" in messages.headers and not responses.headers
    assert responses.keeps_output and not messages.keeps_output
