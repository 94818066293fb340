"""The admin credential: what a change through the admin API must present (design §5.1).

The admin API listens on loopback, so only this machine reaches it; but every user of the
machine does. A read (the catalog, the pool page) may come from any of them. A change
(`POST`: a refresh, a restart, a model load) must come from someone who may run the Edge
itself: the credential lives in `edge.state_dir`, and the file's permissions are the
boundary.

Rules:
1. `serve` keeps the credential in `edge.state_dir/admin.token` (`ADMIN_TOKEN_FILE`): it
   creates the file at its first start (random, mode 0600, linked into place whole, so
   two replicas starting together agree), then reads it at every start. A restart's
   successor, a replica on the same `state_dir` and the CLI all read the same one.
2. Every admin `POST` carries it as `Authorization: Bearer <token>`, compared in
   constant time; without it, or with another, the answer is 401 naming the file.
3. The `iop-edge` commands that change something read the file from the config's
   `edge.state_dir` (`--config`, or the config they find by default), or from
   `--admin-token-file`. A user who cannot read it cannot change the Edge.
4. Blocking file I/O: run `load_or_create` in a worker thread, or before the loop.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Final

__all__ = ["ADMIN_TOKEN_FILE", "AdminCredentialUnusable", "load_or_create", "matches", "read"]

ADMIN_TOKEN_FILE: Final = "admin.token"
#: A credential far larger is not one this module wrote.
_MAX_BYTES: Final = 256


class AdminCredentialUnusable(Exception):
    """The credential file cannot be read or made; the message names it."""


def load_or_create(state_dir: Path) -> str:
    """Rule 1: the credential, made on first use; raises `AdminCredentialUnusable`.
    Made whole in a file of its own, then linked into place: whoever links first wins,
    and no one ever reads it half written."""
    path = state_dir / ADMIN_TOKEN_FILE
    if path.exists():
        return read(path)
    token = secrets.token_urlsafe(32)
    draft = state_dir / f".{ADMIN_TOKEN_FILE}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, token.encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(draft, path)
        except FileExistsError:  # another process made it first
            return read(path)
    except OSError as exc:
        raise AdminCredentialUnusable(f"cannot create {path}: {exc.strerror or exc}") from None
    finally:
        draft.unlink(missing_ok=True)
    return token


#: What to do about an Edge's own credential file that holds none.
REMAKE: Final = "remove it, and the Edge makes a new one at its next start"


def read(path: Path, *, advice: str = REMAKE) -> str:
    """The credential in `path` (Rule 3); raises `AdminCredentialUnusable`, with `advice`
    for a file that holds none."""
    try:
        with path.open("rb") as file:
            data = file.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise AdminCredentialUnusable(f"cannot read {path}: {exc.strerror or exc}") from None
    token = data.decode("ascii", errors="replace").strip()
    if not token or len(data) > _MAX_BYTES or any(c.isspace() for c in token):
        raise AdminCredentialUnusable(f"{path} does not hold an admin credential: {advice}")
    return token


def matches(authorization: str | None, token: str) -> bool:
    """Rule 2: whether an `Authorization` header presents `token`."""
    if authorization is None or not token:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())
