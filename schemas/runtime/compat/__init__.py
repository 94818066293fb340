"""Compatibility with the OpenTelemetry SDK's OTLP exporter, behind one module (its private
parts are read here only, with the versions they were checked against)."""
