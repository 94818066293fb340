"""OpenTelemetry traces, set up the same way by both processes (design §16).

Why here: the Edge and the Node read the same settings (the Edge config's
`edge.telemetry`, the Node's `--otlp-*` flags or its `--config` file's `telemetry`, and
the standard `OTEL_*` environment variables), start the same SDK pipeline and speak the
same GenAI vocabulary; `schemas` is the one package both may import (a Node never
imports the Edge). How spans are recorded and exported is `schemas.runtime.spans`; what each
process records lives beside the code it watches: `iop_edge.runtime.metering.tracing`
(the Edge's span per request) and `iop_node.tracing` (a span per attempt, and the
upstream call as its child).

Rules:
1. Off by default. Tracing is on only when an endpoint is set (the config or a flag, else
   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`) and
   `OTEL_SDK_DISABLED` is not `true`. Off, no OpenTelemetry module is imported and each
   process holds `None` where its tracer would be: a request pays one None check.
2. A key set in the config (or a flag) wins over its environment variable; a variable
   fills in what the config leaves unset; then the defaults (`http/protobuf`,
   `parentbased_always_on` at ratio 1, service `iop-edge` / `iop-node`).
3. OTLP over HTTP with protobuf is the one export format (the SDK's HTTP exporter):
   another protocol (`grpc`, `http/json`) is refused at startup with the variable named.
   The exporter reads its other standard variables itself (`OTEL_EXPORTER_OTLP_HEADERS`,
   `..._TIMEOUT`, `..._CERTIFICATE`, `..._COMPRESSION`; the `TRACES_` ones first).
4. Spans leave in batches from the SDK's own thread (`BatchSpanProcessor`): the request
   path only hands a finished span to a bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`, 2048 by
   default). A slow or absent receiver costs spans, never requests (`schemas.runtime.spans`).
5. Attributes name things and count them (models, providers, ids, token counts, codes);
   never a prompt, a completion or a token.
6. Trace context is W3C `traceparent`/`tracestate`. A well-formed `traceparent` from a
   caller is continued; a malformed one, or a `tracestate` longer than the standard's 512
   characters, is ignored as if absent.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, get_args
from urllib.parse import urlsplit

from schemas.config import OtlpProtocol, ProviderConfig, TelemetrySection, TraceSampler

__all__ = [
    "OPERATION_NAMES",
    "OTEL_EXTRA",
    "TelemetryError",
    "TelemetryUnavailable",
    "TraceSettings",
    "endpoint_problem",
    "provider_name",
    "trace_settings",
    "valid_traceparent",
    "valid_tracestate",
]

#: The optional dependency group that brings the SDK and its OTLP/HTTP exporter.
OTEL_EXTRA: Final = "iop-gateway[otel]"
TRACES_PATH: Final = "/v1/traces"
DEFAULT_PROTOCOL: Final[OtlpProtocol] = "http/protobuf"
DEFAULT_SAMPLER: Final[TraceSampler] = "parentbased_always_on"
#: How long a stopping process waits for its last spans to leave, whatever the collector
#: does (one that accepts and never answers included): spans not sent by then are lost,
#: a stop is never held up.
SHUTDOWN_TIMEOUT_S: Final = 1.0
#: The W3C limit on `tracestate` (32 list members of at most 256 characters is more; the
#: standard lets a vendor cut it at 512).
MAX_TRACESTATE_CHARS: Final = 512

_SAMPLERS: Final[frozenset[TraceSampler]] = frozenset(get_args(TraceSampler))
_PROTOCOLS: Final[frozenset[str]] = frozenset(get_args(OtlpProtocol))
_RATIO_SAMPLERS: Final = frozenset({"traceidratio", "parentbased_traceidratio"})
#: Version 00 of W3C trace context, and any later version read as 00 (its first four
#: fields), as the standard asks of a parser; all-zero ids and version ff are invalid.
_TRACEPARENT: Final = re.compile(
    r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$"
)

#: IOP's operations as `gen_ai.operation.name`: the conventions' well-known values where
#: one fits (Messages and Responses are chat: a conversation in, a message out); a
#: token count is not a GenAI operation the conventions name, so it keeps its own.
OPERATION_NAMES: Final[Mapping[str, str]] = {
    "chat": "chat",
    "completion": "text_completion",
    "embedding": "embeddings",
    "messages": "chat",
    "responses": "chat",
    "count_tokens": "count_tokens",
}

#: API hosts that are one of the conventions' well-known `gen_ai.provider.name` values.
_KNOWN_API_HOSTS: Final[Mapping[str, str]] = {
    "api.openai.com": "openai",
    "api.anthropic.com": "anthropic",
    "api.groq.com": "groq",
    "api.mistral.ai": "mistral_ai",
    "api.deepseek.com": "deepseek",
    "api.x.ai": "x_ai",
    "api.perplexity.ai": "perplexity",
    "api.cohere.com": "cohere",
    "generativelanguage.googleapis.com": "gcp.gemini",
}


def provider_name(provider: ProviderConfig) -> str:
    """`gen_ai.provider.name` of a provider: a well-known value of the GenAI conventions
    where one fits (an `openai_api` provider at api.openai.com is `openai`), else the
    provider's type (`vllm`, `ollama`, `sglang`, ...), which names the runtime."""
    if provider.type == "openai_api" and provider.adapter.base_url:
        known = _known_api(provider.adapter.base_url)
        if known is not None:
            return known
    return provider.type


@functools.lru_cache(maxsize=256)
def _known_api(base_url: str) -> str | None:
    """The well-known provider whose API `base_url` is (asked per traced span: a
    config's few URLs, each parsed once)."""
    try:
        host = urlsplit(base_url).hostname or ""
    except ValueError:
        return None
    return _KNOWN_API_HOSTS.get(host)


def valid_traceparent(value: str) -> bool:
    return bool(value) and _TRACEPARENT.match(value) is not None


def valid_tracestate(value: str) -> bool:
    return len(value) <= MAX_TRACESTATE_CHARS


class TelemetryError(Exception):
    """The trace settings cannot be used; the message names the setting."""


class TelemetryUnavailable(TelemetryError):
    """Tracing is configured but the OpenTelemetry SDK is not installed."""


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """Where and how a process exports its spans (Rule 2 applied)."""

    endpoint: str
    """The full OTLP/HTTP traces URL (ends in `/v1/traces` unless the operator's traces
    endpoint says otherwise)."""
    sampler: TraceSampler
    sampler_arg: float
    service_name: str
    source: str
    """Which setting turned tracing on (for messages): a config key, a flag or a variable."""


def endpoint_problem(url: str) -> str | None:
    """Why `url` cannot be an OTLP/HTTP endpoint, or None when it can."""
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number from 0 to 65535 raises
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (
            f"{url!r} is not an http:// or https:// URL; OTLP/HTTP receivers listen on "
            "e.g. http://collector:4318"
        )
    if port == 0:
        return f"{url!r}: port 0 is no receiver's port"
    return None


def trace_settings(
    section: TelemetrySection | None,
    environ: Mapping[str, str],
    *,
    default_service: str,
    names: Mapping[str, str],
) -> TraceSettings | None:
    """The process's trace settings, or None when tracing is off (Rules 1-3).

    `names` maps each `TelemetrySection` field to how the operator spells it (a config
    path, a flag): error messages name the setting that is wrong. Raises
    `TelemetryError`."""
    section = section or TelemetrySection()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint: str | None
    if section.endpoint is not None:
        endpoint, source = _traces_url(section.endpoint), names["endpoint"]
    elif environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        endpoint = environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()
        source = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        # The standard: the signal's path is appended to the base endpoint.
        endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + TRACES_PATH
        source = "OTEL_EXPORTER_OTLP_ENDPOINT"
    else:
        return None
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise TelemetryError(f"{source}: {problem}")
    _check_protocol(section, environ, names)
    sampler = _sampler(section, environ, names)
    return TraceSettings(
        endpoint=endpoint,
        sampler=sampler,
        sampler_arg=_sampler_arg(section, environ, sampler),
        service_name=section.service_name
        or environ.get("OTEL_SERVICE_NAME", "").strip()
        or default_service,
        source=source,
    )


def _traces_url(endpoint: str) -> str:
    """A configured endpoint as the traces URL: a base URL gets `/v1/traces`."""
    stripped = endpoint.rstrip("/")
    return stripped if stripped.endswith(TRACES_PATH) else stripped + TRACES_PATH


def _check_protocol(
    section: TelemetrySection, environ: Mapping[str, str], names: Mapping[str, str]
) -> None:
    if section.protocol is not None:
        return  # the schema allows only what is supported
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(variable, "").strip()
        if not value:
            continue
        if value not in _PROTOCOLS:
            raise TelemetryError(
                f"{variable}={value}: IOP exports traces over OTLP/HTTP with protobuf only "
                f"({DEFAULT_PROTOCOL}; receivers take it on port 4318 by convention); "
                f"unset it or set {names['protocol']}"
            )
        return


def _sampler(
    section: TelemetrySection, environ: Mapping[str, str], names: Mapping[str, str]
) -> TraceSampler:
    if section.sampler is not None:
        return section.sampler
    value = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if not value:
        return DEFAULT_SAMPLER
    for sampler in _SAMPLERS:
        if sampler == value:
            return sampler
    raise TelemetryError(
        f"OTEL_TRACES_SAMPLER={value}: not a sampler IOP knows; use one of "
        f"{', '.join(sorted(_SAMPLERS))} (or set {names['sampler']})"
    )


def _sampler_arg(
    section: TelemetrySection, environ: Mapping[str, str], sampler: TraceSampler
) -> float:
    if section.sampler_arg is not None:
        return section.sampler_arg
    value = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if not value or sampler not in _RATIO_SAMPLERS:
        return 1.0
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        raise TelemetryError(
            f"OTEL_TRACES_SAMPLER_ARG={value}: the ratio of {sampler} is a number from 0 to 1"
        )
    return ratio
