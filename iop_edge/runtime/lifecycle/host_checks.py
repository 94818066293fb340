"""Validation that looks at this machine: what `serve` needs from the host, checked
read-only at load time, so `check-config` (and a refresh candidate) never passes a config
that `serve` then refuses (design §12).

Rules:
1. `edge.tls`: the certificate chain and key load, through the very call `serve` makes
   (`node_tls_context`): readable files, PEM, a key that matches, no passphrase (a
   service cannot type one).
2. `edge.state_dir`: an existing directory the Edge may write into, or a path it can
   create (its nearest existing ancestor is such a directory).
Paths are taken as `serve` takes them: relative to the working directory.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from schemas.config import ConfigError, EdgeConfig, TlsSection

__all__ = ["check_host", "node_tls_context"]


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _EncryptedKey


def node_tls_context(tls: TlsSection) -> ssl.SSLContext:
    """The node listener's TLS context; raises `ValueError` saying what is wrong."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_passphrase)
    except _EncryptedKey:
        raise ValueError(
            f"the key {tls.key_file} is protected by a passphrase; give the Edge an "
            "unencrypted key (readable by its user only)"
        ) from None
    except (TypeError, ValueError) as exc:  # a name the OS cannot take (a NUL byte...)
        raise ValueError(f"cannot use {tls.cert_file!r} / {tls.key_file!r}: {exc}") from None
    except OSError as exc:  # ssl.SSLError is an OSError too
        if isinstance(exc, ssl.SSLError):
            raise ValueError(
                f"cannot load {tls.cert_file} with {tls.key_file}: {exc.reason or exc} "
                "(both must be PEM, and the key must belong to the certificate)"
            ) from None
        raise ValueError(
            f"cannot read {exc.filename or tls.cert_file}: {exc.strerror or exc}"
        ) from None
    return context


def check_host(config: EdgeConfig) -> list[ConfigError]:
    errors: list[ConfigError] = []
    if config.edge.tls is not None:
        try:
            node_tls_context(config.edge.tls)
        except ValueError as exc:
            errors.append(ConfigError(path="edge.tls", message=str(exc)))
    problem = _state_dir_problem(Path(config.edge.state_dir))
    if problem is not None:
        errors.append(ConfigError(path="edge.state_dir", message=problem))
    return errors


def _state_dir_problem(path: Path) -> str | None:
    try:
        return _state_dir_check(path)
    except (OSError, ValueError) as exc:  # a name the OS cannot take (a NUL byte...)
        return f"{path!r} cannot be used as a directory here: {exc}"


def _state_dir_check(path: Path) -> str | None:
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{path} is not writable by this user (the usage ledger lives there)"
        return None
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{path} does not exist and cannot be created ({ancestor} is not writable)"
    return None
