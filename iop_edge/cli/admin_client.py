"""How the admin client commands find and call the Edge's admin API (Rules 1, 3 and 4 of
the package docstring): the URL from `--admin` or a config's `admin.listen`, one JSON call,
the server's own message on an error, and a console that ends quietly on a closed pipe.
A change (`POST`) presents the admin credential (`lifecycle.admin_credential`), read from
`--admin-token-file` or the config's `edge.state_dir`."""

from __future__ import annotations

import argparse
import json
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import yaml
from rich.console import Console

from iop_edge.cli import config_lookup as lookup
from iop_edge.cli.errors import fail
from iop_edge.core.configuration.config import ConfigInvalid, format_errors
from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.runtime.lifecycle import admin_credential
from iop_edge.runtime.refresh.config_file import load_config
from schemas.runtime import safe_yaml

#: A config read and checked once per admin call, however many of its settings the call
#: needs (whether a candidate loads, the admin URL, the credential's folder): a fleet's
#: takes seconds. `admin_call` empties it first, so a file changed since is read anew.
_load_config = lru_cache(maxsize=4)(load_config)


def _config_for_admin(args: argparse.Namespace) -> Path:
    """Which config's `admin.listen` locates the Edge (Rule 4)."""
    if args.config is not None:
        return Path(args.config)
    candidate = getattr(args, "candidate", None)
    if candidate and _loads(Path(candidate)):
        return Path(candidate)
    return lookup.config_or_default(
        None, needed_by="cannot find the admin API: ", advice=lookup.FOR_ADMIN
    )


def _credential(args: argparse.Namespace, located: Path | None) -> str:
    """The admin credential a change presents: `--admin-token-file`'s, else the one in
    the `edge.state_dir` of the config that located the Edge (`located`), else of
    `--config` or the default config."""
    path: Path | None = getattr(args, "admin_token_file", None)
    advice = admin_credential.REMAKE
    if path is not None:
        advice = (
            f"give --admin-token-file the Edge's own ({admin_credential.ADMIN_TOKEN_FILE} "
            "in its edge.state_dir)"
        )
    else:
        try:
            config = located or lookup.config_or_default(
                args.config,
                needed_by="a change to the Edge needs its admin credential: ",
                advice="Pass --config with the Edge's config (the credential is in its "
                "edge.state_dir), or --admin-token-file FILE",
            )
        except lookup.NoConfig as exc:
            fail(str(exc))
        path = _state_dir(config) / admin_credential.ADMIN_TOKEN_FILE
    try:
        return admin_credential.read(path, advice=advice)
    except admin_credential.AdminCredentialUnusable as exc:
        relative = (
            ""
            if path.is_absolute()
            else (
                f" ({path.parent} is relative to the folder the Edge started in, which the "
                "Edge logs with the credential's path at start: 'admin credential: ...')"
            )
        )
        fail(
            f"{exc}{relative}. A change to the Edge needs its admin credential: run this as "
            "a user who may read it (the Edge's own, or root), or pass --admin-token-file FILE"
        )


def _state_dir(config: Path) -> Path:
    """`config`'s `edge.state_dir`, read leniently: a config the Edge would refuse (one
    whose change failed) still says where the Edge keeps its credential."""
    try:
        return Path(_load_config(config).config.edge.state_dir)
    except ConfigInvalid:
        pass
    try:
        text = config.read_text(encoding="utf-8")
        state_dir = safe_yaml.load(text, unique_keys=False)["edge"]["state_dir"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError) as exc:
        fail(
            f"cannot read edge.state_dir from {config} ({exc}), where the admin credential "
            "is: pass --admin-token-file FILE"
        )
    return Path(str(state_dir))


def _loads(path: Path) -> bool:
    try:
        _load_config(path)
    except ConfigInvalid:
        return False
    return True


def _given_admin_url(given: str) -> str:
    url = given.rstrip("/")
    if not url.startswith(("http://", "https://")):
        fail(f"--admin must be a URL like http://127.0.0.1:7701, got {given!r}")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # the port is read to check it is a number
    except ValueError as exc:  # not a number, or an unclosed [IPv6 literal
        fail(f"--admin {given!r} is not a URL: {exc}")
    if not host:
        fail(f"--admin {given!r} names no host: http://HOST:PORT")
    return url


def _admin_url_of(path: Path) -> str:
    """The admin URL of `path`, the config that locates the Edge: its `admin.listen`."""
    try:
        listen = _load_config(path).config.admin.listen
    except ConfigInvalid as exc:
        fail(
            f"cannot find the admin API from {path} (its admin.listen):\n"
            f"{format_errors(exc.errors)}\n"
            "Fix the file, or pass --admin http://HOST:PORT"
        )
    address = parse_listen_address(listen)
    if address.port == 0:
        fail(
            f"{path} has admin.listen {listen}: the Edge picked a free port when it started. "
            "Pass --admin with the URL it logged ('admin API listening on http://...')"
        )
    return f"http://{address}"


def admin_call(
    args: argparse.Namespace, method: str, path: str, body: Any = None, *, timeout: float = 120
) -> tuple[int, Any]:
    import httpx2

    _load_config.cache_clear()
    located: Path | None = None
    if args.admin:
        base = _given_admin_url(str(args.admin))
    else:
        located = _config_for_admin(args)
        base = _admin_url_of(located)
    changes = method == "POST"
    headers = {"authorization": f"Bearer {_credential(args, located)}"} if changes else {}
    try:
        with httpx2.Client(timeout=timeout) as client:
            response = client.request(method, base + path, json=body, headers=headers)
    except httpx2.TransportError as exc:
        fail(
            f"cannot reach the admin API at {base} ({exc}). Is the Edge running? "
            "Pass --admin with the URL it logged ('admin API listening on ...')"
        )
    try:
        document = response.json()
    except ValueError:
        if not response.text.strip():  # the node listener's answer to plain HTTP
            fail(
                f"{base} answered HTTP {response.status_code} with nothing: it is not the "
                f"Edge's admin API (its node listener answers so). {_FIND_ADMIN}"
            )
        fail(f"the admin API at {base} answered HTTP {response.status_code}: {response.text[:300]}")
    if response.status_code == 404 and _code(document) == "unknown_url":
        fail(f"{base} is the Edge's caller API (OpenAI), not its admin API. {_FIND_ADMIN}")
    return response.status_code, document


#: Where the admin API is, for an operator who pointed a command elsewhere.
_FIND_ADMIN: Final = (
    "Pass --admin with admin.listen's address (the Edge logs 'admin API listening on "
    "http://...'), or --config with the Edge's config"
)


def _code(document: Any) -> str | None:
    error = document.get("error") if isinstance(document, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else None


def server_message(document: Any) -> str:
    """The message of an admin API error body (`{"error": {"message": ...}}`)."""
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return json.dumps(document)


def admin_get(args: argparse.Namespace, path: str) -> Any:
    status, document = admin_call(args, "GET", path)
    if status != 200:
        fail(f"the admin API answered HTTP {status}: {server_message(document)}")
    return document


class _PipedConsole(Console):
    """rich's Console, leaving a closed pipe to `main` (Rule 3): rich's own handling exits
    with 1, which a shell script reads as a failure; `main` exits 141, as a program
    stopped by SIGPIPE does."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written, not even at exit
        raise BrokenPipeError


def piped_console() -> Console:
    return _PipedConsole(highlight=False)


def admin_flags(args: argparse.Namespace) -> list[str]:
    """The `--admin` or `--config` the command was given, for a command it prints to be
    run next (a next page): pasted anywhere, it reaches the same Edge."""
    if args.admin:
        return [f"--admin {shlex.quote(args.admin)}"]
    if args.config is not None:
        return [f"--config {shlex.quote(str(args.config.resolve()))}"]
    return []


def add_admin(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--admin",
        metavar="URL",
        help="the Edge's admin API, e.g. http://127.0.0.1:7701 (default: admin.listen of "
        f"--config, else of {lookup.describe_defaults()})",
    )
    command.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="an Edge config whose admin.listen locates the Edge (only that is read)",
    )
    command.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the admin credential a change presents (default: admin.token in the "
        "edge.state_dir of --config, else of the default config)",
    )
    command.add_argument(
        "--json", action="store_true", help="print the admin API's JSON document as it is"
    )
