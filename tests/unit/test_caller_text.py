"""What a caller's error may say: no provider, node, host or port (`core.caller_text`)."""

from __future__ import annotations

import pytest

from iop_edge.core.caller_text import (
    ADDRESS,
    CREDENTIAL,
    upstream_identifier,
    with_request_id,
    without_credentials,
    without_topology,
)


@pytest.mark.parametrize(
    ("said", "names", "caller_reads"),
    [
        (
            "provider 'gpu1-llama' failed: 127.0.0.1:24410 unreachable",
            ("gpu1-llama",),
            f"the provider failed: {ADDRESS} unreachable",
        ),
        (
            "cannot connect: [Errno 111] Connect call failed ('127.0.0.1', 24410)",
            (),
            f"cannot connect: [Errno 111] Connect call failed {ADDRESS}",
        ),
        (
            "node 'n1' disconnected during the run",
            (),
            "the node disconnected during the run",
        ),
        ("see http://gpu1.lan:8000/v1/chat/completions", (), f"see {ADDRESS}"),
        ("dial localhost:8080 or [::1]:80 failed", (), f"dial {ADDRESS} or {ADDRESS} failed"),
        ("gpu1-llama ran out of memory", ("gpu1-llama",), "the provider ran out of memory"),
        # what is no address stays
        ("upstream stream ended before [DONE]", ("llama",), "upstream stream ended before [DONE]"),
        ("retry after 12:30, 2 of 8192 tokens", (), "retry after 12:30, 2 of 8192 tokens"),
        (
            "gpu1-llama-2 is another provider's id",
            ("gpu1-llama",),
            "gpu1-llama-2 is another provider's id",
        ),
    ],
)
def test_without_topology(said: str, names: tuple[str, ...], caller_reads: str) -> None:
    assert without_topology(said, names) == caller_reads


def test_with_request_id() -> None:
    assert with_request_id("it failed", "req_1") == "it failed (request id req_1)"
    assert with_request_id("it failed", "") == "it failed"


@pytest.mark.parametrize(
    ("said", "caller_reads"),
    [
        (
            "Incorrect API key provided: sk-proj-REALKEY0123456789. You can find your API key",
            f"Incorrect API key provided: {CREDENTIAL}. You can find your API key",
        ),
        ("invalid x-api-key sk-ant-api03-abcdEFGH_ijkl", f"invalid x-api-key {CREDENTIAL}"),
        (
            "Authorization: Bearer abcdef123456789 refused",
            f"Authorization: Bearer {CREDENTIAL} refused",
        ),
        ('bad api_key="s3cr3tvalue" here', f'bad api_key="{CREDENTIAL}" here'),
        ("key AIzaSyA1234567890abcdefghijklmnop expired", f"key {CREDENTIAL} expired"),
        ("token gsk_0123456789abcdef revoked", f"token {CREDENTIAL} revoked"),
        # what is no credential stays
        (
            "model Qwen3-Coder-30B-A3B-Instruct not found",
            "model Qwen3-Coder-30B-A3B-Instruct not found",
        ),
        ("the task-queue is full; tokens: 32768", "the task-queue is full; tokens: 32768"),
    ],
)
def test_credentials_are_taken_out(said: str, caller_reads: str) -> None:
    assert without_credentials(said) == caller_reads
    assert without_topology(said) == caller_reads


@pytest.mark.parametrize(
    ("said", "caller_reads"),
    [
        ("context_length_exceeded", "context_length_exceeded"),
        ("messages[0].content", "messages[0].content"),
        ("tools.1.function:name", "tools.1.function:name"),
        (None, None),
        ("", None),
        ("x" * 65, None),  # longer than an identifier
        ("not an identifier", None),
        ("sk-proj-abcdefgh1234", None),  # a key
        ("gpu1-llama", None),  # the provider's id
        ("10.0.0.5:8000", None),  # an address
    ],
)
def test_an_upstream_code_or_param_passes_whole_or_not_at_all(
    said: str | None, caller_reads: str | None
) -> None:
    assert upstream_identifier(said, ("gpu1-llama",)) == caller_reads
