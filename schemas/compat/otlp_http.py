"""The OpenTelemetry OTLP/HTTP span exporter, encoding with IOP's encoder.

`OTLPSpanExporter.export` encodes a batch with the SDK's protobuf objects and hands the
bytes to its HTTP client (`_client.export`), which does everything else: the URL, the
headers (`OTEL_EXPORTER_OTLP_HEADERS`), compression, TLS, the timeout, retries with
backoff. Encoding is most of a traced request's cost (`schemas.otlp_encoding`), so
`span_exporter` keeps the exporter and its client and swaps only the encoding: the
batch is written by `schemas.otlp_encoding.encode_spans` (the same message) and given to
the same client. That reads the exporter's private `_client` and `_shutdown`, as
opentelemetry-exporter-otlp-proto-http 1.45 has them.

`FAST_ENCODING` says whether the installed exporter is one known to work that way
(`tests/compat/test_otlp_http.py` proves it against a real receiver). When it is not,
`span_exporter` returns the stock exporter: slower to encode, equally correct. This
module is the only place that names the exporter's private attributes; it is imported
only when tracing is on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib.metadata import version
from typing import Final

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from schemas.otlp_encoding import encode_spans

__all__ = ["FAST_ENCODING", "span_exporter"]

log = logging.getLogger(__name__)

_KNOWN_MINOR_VERSIONS: Final = ("1.45.",)

FAST_ENCODING: Final = version("opentelemetry-exporter-otlp-proto-http").startswith(
    _KNOWN_MINOR_VERSIONS
)
"""Whether this exporter sends through a client `span_exporter` can hand bytes to."""


class _FastEncoding(OTLPSpanExporter):
    """`OTLPSpanExporter` with `schemas.otlp_encoding` in place of its encoder."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        try:
            data = encode_spans(spans)
        except Exception:  # a value the encoder cannot write: the batch, not the process
            log.exception("could not encode %d spans", len(spans))
            return SpanExportResult.FAILURE
        result = self._client.export(data)
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP/HTTP exporter to `endpoint` (the full traces URL), encoding fast when it
    can (`FAST_ENCODING`)."""
    if FAST_ENCODING:
        return _FastEncoding(endpoint=endpoint)
    return OTLPSpanExporter(endpoint=endpoint)
