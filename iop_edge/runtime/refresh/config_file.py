"""The Edge config as the Edge meets it: a file on this machine, checked against this
machine (design §2, §12).

`core.configuration.config` validates text and touches nothing; this is the one place
that reads the config file and adds the host's rules (`lifecycle.host_checks`: the TLS
files load, `state_dir` is writable or creatable), so `serve`, `check-config`, the demo
and every refresh candidate apply the same rules, and `check-config` never says OK to a
config `serve` would refuse.

Rules:
1. The file is read as bytes and decoded as UTF-8 without newline translation, so the
   config's `sha256` is the digest of the file exactly as it sits on disk. An unreadable
   file, or one that is not UTF-8, is `ConfigInvalid` with one error for the whole file.
2. The host's rules run only on a config that passed every other rule (their errors
   would otherwise be noise about a config that cannot be served anyway).
3. A config is read with the collector paused (`runtime.lifecycle.heap` Rule 6): what is
   read is long-lived, and a fleet's config would otherwise be walked again and again
   as it grows.
"""

from __future__ import annotations

import os

from iop_edge.core.configuration.config import (
    ConfigInvalid,
    ParsedConfig,
    parse_config,
    whole_file_error,
)
from iop_edge.core.configuration.config_proof import ConfigProof
from iop_edge.runtime.lifecycle.heap import building
from iop_edge.runtime.lifecycle.host_checks import check_host

__all__ = ["check_config", "load_config"]


def check_config(text: str, *, proof: ConfigProof | None = None) -> ParsedConfig:
    """Validate config text, this machine's rules included (Rule 2); raise
    `ConfigInvalid` listing every problem."""
    with building():  # Rule 3
        parsed = parse_config(text, proof=proof)
        errors = check_host(parsed.config)
    if errors:
        raise ConfigInvalid(errors)
    return parsed


def load_config(path: str | os.PathLike[str], *, proof: ConfigProof | None = None) -> ParsedConfig:
    """Read and validate the config file at `path` (Rules 1, 2)."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise whole_file_error(f"cannot read config file {os.fspath(path)}: {reason}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise whole_file_error(
            f"config file {os.fspath(path)} is not valid UTF-8 (byte offset {exc.start})"
        ) from exc
    return check_config(text, proof=proof)
