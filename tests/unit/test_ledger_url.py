"""`edge.ledger` (`iop_edge.core.configuration.ledger_url`): where the usage ledger lives."""

from __future__ import annotations

import pytest

from iop_edge.core.configuration.ledger_url import PostgresUrl, parse_ledger_url


def test_a_postgres_url_names_its_parts() -> None:
    url = parse_ledger_url("postgresql://iop@db.example:5433/usage?sslmode=require")
    assert url == PostgresUrl(
        url="postgresql://iop@db.example:5433/usage?sslmode=require",
        host="db.example",
        port=5433,
        user="iop",
        database="usage",
    )
    assert parse_ledger_url("postgres://iop@db/usage").database == "usage"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("sqlite:///var/usage.db", "must be a PostgreSQL URL"),
        ("db.example:5432", "must be a PostgreSQL URL"),
        ("postgresql://iop:s3cret@db/usage", "must not contain a password"),
        ("postgresql://iop@db/usage?password=s3cret", "must not contain a password"),
        ("postgresql://iop@db/usage?sslmode=require&sslpassword=s3cret", "(sslpassword)"),
        ("postgresql://iop@db", "must name one database"),
        ("postgresql://iop@db/a/b", "must name one database"),
        ("postgresql://iop@db:99999/usage", "the port must be a number"),
    ],
)
def test_what_is_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        parse_ledger_url(text)
    assert "s3cret" not in str(caught.value)
