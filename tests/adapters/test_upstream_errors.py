"""`iop_node.adapters.upstream_errors`: the code and field an upstream's refusal names, in
each runtime's dialect (bodies as the runtimes write them)."""

from __future__ import annotations

import pytest

from iop_node.adapters.upstream_errors import ErrorFacts, read_error_facts
from schemas.wire import Operation

#: llama-cpp-python 0.3.36 (measured), non-stream, `--n_ctx 512`.
LLAMA_CPP_PYTHON = (
    b'{"error":{"message":"This model\'s maximum context length is 512 tokens. However, you '
    b"requested 936 tokens (931 in the messages, 5 in the completion). Please reduce the "
    b'length of the messages or completion.","type":"invalid_request_error","param":'
    b'"messages","code":"context_length_exceeded"}}'
)
#: llama.cpp's llama-server.
LLAMA_SERVER = (
    b'{"error":{"code":400,"message":"request (9412 tokens) exceeds the available context '
    b'size (8192 tokens), try increasing it","type":"exceed_context_size_error",'
    b'"n_prompt_tokens":9412,"n_ctx":8192}}'
)
#: vLLM.
VLLM = (
    b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens. '
    b'However, you requested 5000 tokens.","type":"BadRequestError","param":null,"code":400}'
)


@pytest.mark.parametrize(
    ("body", "operation", "facts"),
    [
        (LLAMA_CPP_PYTHON, "chat", ErrorFacts("context_length_exceeded", "messages", 512)),
        (LLAMA_SERVER, "chat", ErrorFacts("context_length_exceeded", "messages", 8192)),
        (LLAMA_SERVER, "completion", ErrorFacts("context_length_exceeded", "prompt", 8192)),
        (VLLM, "chat", ErrorFacts("context_length_exceeded", "messages", 4096)),
        (
            b'{"error":{"message":"bad","type":"invalid_request_error","param":"temperature",'
            b'"code":"invalid_value"}}',
            "chat",
            ErrorFacts("invalid_value", "temperature"),
        ),
        (
            b'{"error":{"message":"bad","code":400,"type":"invalid_request_error"}}',
            "chat",
            ErrorFacts(),
        ),
        (b'{"detail":"Not Found"}', "chat", ErrorFacts()),
        (b"<html>bad gateway</html>", "chat", ErrorFacts()),
        (b"[1, 2]", None, ErrorFacts()),
        (
            b'{"error":"maximum context length is 77 tokens"}',
            None,
            ErrorFacts("context_length_exceeded", None, 77),
        ),
    ],
)
def test_error_facts_in_every_dialect(
    body: bytes, operation: Operation | None, facts: ErrorFacts
) -> None:
    assert read_error_facts(body, operation) == facts
