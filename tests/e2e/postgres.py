"""A throwaway PostgreSQL server for the ledger tests (`bench.postgres` starts it and
says what it needs). Without what it needs the tests that use it are skipped, saying
why; under CI (`CI=true`) they fail instead, so CI can never pass without running them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.postgres import Postgres, PostgresUnavailable, create_database, throwaway_postgres

__all__ = ["PASSWORD_ENV", "Postgres", "create_database", "start_postgres", "unavailable"]

PASSWORD_ENV = "IOP_TEST_LEDGER_PASSWORD"


def unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the PostgreSQL tests, but {reason}")
    pytest.skip(f"PostgreSQL tests skipped: {reason}")


def start_postgres() -> Iterator[Postgres]:
    """Start the server; yields it; stops it and removes its files."""
    try:
        with throwaway_postgres() as server:
            yield server
    except PostgresUnavailable as exc:  # raised before it yields: nothing ran yet
        unavailable(str(exc))
