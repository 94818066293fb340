"""Which Edge config a command reads when it is given none (`serve`, and the commands that
locate the admin API through a config's `admin.listen`).

An installed `iop-edge` runs from any folder, so the default cannot be a path inside this
repository. Rules:

1. The places, in order: `./edge.yaml` (the folder the command runs in, as after
   `cd edge` following `iop-edge init edge`), then `/etc/iop/edge.yaml` (where
   `iop-edge init /etc/iop` puts the systemd unit's config). The first that exists is
   the default; `--config` always wins and is never looked up.
2. A command that uses a default says which file it read (one line on stderr), so an
   operator never wonders which of two configs an Edge runs.
3. When none exists, the error names every place looked at and the folder `./` was, then
   the ways on: `--config FILE`, or `iop-edge init` to write one (`serve`), or `--admin
   URL` (the commands that only locate the admin API).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

#: Rule 1's places, in the order they are tried.
DEFAULT_CONFIGS: Final = (Path("edge.yaml"), Path("/etc/iop/edge.yaml"))
#: Rule 3's ways on, for `serve` and for the commands that only locate the admin API.
FOR_SERVE: Final = "Pass --config FILE, or write one here with `iop-edge init`"
FOR_ADMIN: Final = (
    "Pass --admin http://127.0.0.1:7701 (the URL the Edge logged as 'admin API listening "
    "on') or --config PATH/TO/edge.yaml"
)


class NoConfig(Exception):
    """No `--config` and no default config: the message says where it looked and what to
    do (Rule 3); the command prints it as its error."""


def config_or_default(named: Path | None, *, advice: str, needed_by: str = "") -> Path:
    """`named` when given, else the default (Rule 1), said on stderr (Rule 2); `NoConfig`
    with `needed_by` and `advice` around Rule 3's finding when there is none."""
    if named is not None:
        return named
    found = find_default_config()
    if found is None:
        raise NoConfig(f"{needed_by}{no_default()}. {advice}")
    if found.absolute() not in _ANNOUNCED:  # a command that looks twice says it once
        _ANNOUNCED.add(found.absolute())
        print(using_default(found), file=sys.stderr)
    return found


#: The default configs the running command has said it uses (Rule 2).
_ANNOUNCED: set[Path] = set()


def forget_announced() -> None:
    """A new command starts: it says again which default config it uses."""
    _ANNOUNCED.clear()


def describe_defaults(places: Sequence[Path] | None = None) -> str:
    """The places as a help text names them: `./edge.yaml, else /etc/iop/edge.yaml`."""
    return ", else ".join(_shown(place) for place in places or DEFAULT_CONFIGS)


def find_default_config(places: Sequence[Path] | None = None) -> Path | None:
    """The first of `places` (default: Rule 1's) that is a file, or None."""
    for place in places or DEFAULT_CONFIGS:
        if place.is_file():
            return place
    return None


def using_default(path: Path) -> str:
    """Rule 2's line: which config the command read, and why that one."""
    return f"iop-edge: using the config {_shown(path)} (no --config given)"


def no_default(places: Sequence[Path] | None = None) -> str:
    """Rule 3's finding, for a command that needs a config and found none; the caller
    adds what to do."""
    looked = " nor ".join(_shown(place) for place in places or DEFAULT_CONFIGS)
    return f"no --config given, and there is no {looked} (./ is {Path.cwd()})"


def _shown(place: Path) -> str:
    return str(place) if place.is_absolute() else f"./{place}"
