"""The OpenTelemetry GenAI metrics, in Prometheus (design §16).

The GenAI semantic conventions name a few histograms every LLM gateway and runtime is
expected to have; here they are under the names an OpenTelemetry collector would give
them in Prometheus (dots to underscores, the unit as a suffix), with the conventions'
bucket boundaries and attributes as labels:

    gen_ai_server_time_to_first_token_seconds     a caller's stream: from the request's
                                                  arrival at the Edge to its first event
    gen_ai_server_time_per_output_token_seconds   a caller's stream: (duration - time to
                                                  first token) / (output tokens - 1)
    gen_ai_client_operation_duration_seconds      every run that reached a provider: from
                                                  arrival to the run's end; `error_type`
                                                  is the error code, "" on success
    gen_ai_client_token_usage                     tokens per run, `gen_ai_token_type`
                                                  input or output

Which side of the conventions: to its callers the Edge *is* the GenAI server, so the
time to first token and per output token are `gen_ai.server.*` as a caller experiences
them (the Edge's queue and the wire included: what the pool delivers, not what one
runtime does alone); the operation's duration and its token usage are `gen_ai.client.*`
measurements made at the Edge, a client of its providers, as a caller's own
instrumentation would see them (minus the network to the caller).

Labels: `gen_ai_operation_name` (chat, text_completion, embeddings, count_tokens; Anthropic
Messages and OpenAI Responses are chat), `gen_ai_request_model` (the model alias the
caller asked for), `gen_ai_provider_name` (the provider's type, or the conventions'
well-known name of a hosted API: `schemas.runtime.telemetry.provider_name`) and `iop_provider_id`
(which provider of the pool). Only successful streams are timed per token (a whole
answer has no first token to time); failures count in the operation's duration with
their `error_type`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry

from iop_edge.runtime.metering.series import HistogramSeries
from schemas.runtime.telemetry import OPERATION_NAMES
from schemas.wire import Usage

__all__ = ["GenAIMetrics"]

# The conventions' advisory bucket boundaries (semantic conventions, gen-ai metrics).
_TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
_TPOT_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
_TOKEN_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
_LABELS: Final = [
    "gen_ai_operation_name",
    "gen_ai_request_model",
    "gen_ai_provider_name",
    "iop_provider_id",
]
_Key = tuple[str, str, str, str]


class GenAIMetrics:
    """The four GenAI histograms of one Edge's registry (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, provider_name: Callable[[str], str]) -> None:
        self._provider_name = provider_name
        self.ttft = HistogramSeries(
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai.server.time_to_first_token: time from a stream request's arrival at the"
            " Edge to its first event, successful streams only (queue wait included)",
            _LABELS,
            registry,
            buckets=_TTFT_BUCKETS,
        )
        self.tpot = HistogramSeries(
            "gen_ai_server_time_per_output_token_seconds",
            "gen_ai.server.time_per_output_token: time per output token after the first,"
            " (duration - time to first token) / (output tokens - 1), successful streams",
            _LABELS,
            registry,
            buckets=_TPOT_BUCKETS,
        )
        self.duration = HistogramSeries(
            "gen_ai_client_operation_duration_seconds",
            "gen_ai.client.operation.duration: a run from the request's arrival at the Edge"
            " to its end, measured by the Edge as its provider's client; error_type is the"
            " error code (empty on success)",
            [*_LABELS, "error_type"],
            registry,
            buckets=_DURATION_BUCKETS,
        )
        self.token_usage = HistogramSeries(
            "gen_ai_client_token_usage",
            "gen_ai.client.token.usage: tokens per run (gen_ai_token_type input or output),"
            " as metered (reported by the provider or estimated)",
            [*_LABELS, "gen_ai_token_type"],
            registry,
            buckets=_TOKEN_BUCKETS,
        )

    def observe(
        self,
        *,
        operation: str,
        model: str,
        provider: str,
        status: int,
        code: str,
        stream: bool,
        latency_s: float,
        ttft_s: float | None,
        usage: Usage | None,
    ) -> None:
        """One run that reached `provider` ended."""
        key: _Key = (
            OPERATION_NAMES.get(operation, operation),
            model,
            self._provider_name(provider),
            provider,
        )
        ok = status < 400
        self.duration.labels(*key, "" if ok else code or str(status)).observe(latency_s)
        if usage is not None:
            self.token_usage.labels(*key, "input").observe(usage.prompt_tokens)
            self.token_usage.labels(*key, "output").observe(usage.completion_tokens)
        if not (ok and stream and ttft_s is not None):
            return
        self.ttft.labels(*key).observe(ttft_s)
        output = usage.completion_tokens if usage is not None else 0
        if output > 1:
            per_token = max(latency_s - ttft_s, 0.0) / (output - 1)
            self.tpot.labels(*key).observe(per_token)
