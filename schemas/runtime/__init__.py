"""Runtime code both processes run, kept apart from the contract's definitions: log lines,
tracing (spans, OTLP encoding, OpenTelemetry set-up), bounded YAML reading, exit status.
It lives under `schemas/` because it is the one package both `iop_edge` and `iop_node`
import."""
