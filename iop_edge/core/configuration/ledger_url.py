"""Where the usage ledger lives: the one parser of `edge.ledger` (design §7, §13).

Rules:
1. No `edge.ledger`: the embedded SQLite ledger in `state_dir` (one Edge, or replicas on
   one host sharing a `state_dir`).
2. `postgresql://USER@HOST[:PORT]/DATABASE` (or `postgres://`): a PostgreSQL ledger that
   several Edges share. Query parameters pass to libpq as they are (`sslmode=require`).
3. A password never sits in the config (design §2.3): not in the URL's user part, not as
   libpq's `password` parameter, nor its `sslpassword` (a client key's passphrase: the key
   file, readable by the Edge's user alone, is the secret then). The password comes from
   the environment variable `edge.ledger_password_env` names, or libpq's own `PGPASSWORD`
   / `~/.pgpass`.
4. The database must be named: a URL without one would silently use the user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

__all__ = ["PostgresUrl", "parse_ledger_url"]

_SCHEMES = ("postgresql", "postgres")
#: libpq's connection parameters that hold a secret (Rule 3).
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


@dataclass(frozen=True, slots=True)
class PostgresUrl:
    url: str
    """The URL as configured (it holds no secret, Rule 3)."""
    host: str
    port: int | None
    user: str
    database: str

    def __str__(self) -> str:
        return self.url


def parse_ledger_url(text: str) -> PostgresUrl:
    """Check an `edge.ledger` value; raises `ValueError` saying what is wrong."""
    parts = urlsplit(text)
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            "must be a PostgreSQL URL, postgresql://USER@HOST:PORT/DATABASE "
            "(leave it out for the SQLite ledger in state_dir)"
        )
    secret = (
        "password"
        if parts.password is not None
        else next(
            (key.lower() for key, _ in parse_qsl(parts.query) if key.lower() in _SECRET_PARAMETERS),
            None,
        )
    )
    if secret == "sslpassword":
        raise ValueError(
            "must not contain the client key's passphrase (sslpassword): use a client key "
            "without one (sslkey), in a file only the Edge's user can read"
        )
    if secret is not None:
        raise ValueError(
            "must not contain a password: put it in an environment variable and name that "
            "variable in edge.ledger_password_env"
        )
    database = parts.path.lstrip("/")
    if not database or "/" in database:
        raise ValueError("must name one database: postgresql://USER@HOST:PORT/DATABASE")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the port must be a number from 1 to 65535") from None
    return PostgresUrl(
        url=text,
        host=parts.hostname or "",
        port=port,
        user=parts.username or "",
        database=database,
    )
