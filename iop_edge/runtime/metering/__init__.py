"""Metering: Prometheus metrics, the access log, recent activity, and the durable usage
ledger (journal, SQLite, PostgreSQL) every finished run is recorded in.
"""
