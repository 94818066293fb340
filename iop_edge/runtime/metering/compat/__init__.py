"""Where metering reaches past prometheus_client's public API: `prometheus.py` names the
internal it reads, and `tests/compat/test_prometheus.py` proves it on the installed
version (`pyproject.toml` bounds that version from above, so an upgrade is a deliberate
act)."""
