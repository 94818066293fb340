"""`iop-node`: the Node's command line (design §2.2, §10).

    iop-node run --edge ws://HOST:PORT [--edge ...] [--edge-dns ws://NAME:PORT]
                 --node-id ID [--token-file F] [--config node.yaml]
                 [--log-level LEVEL] [--log-format text|json]
                 [--otlp-endpoint URL] [--otlp-protocol http/protobuf]
                 [--trace-sampler NAME] [--trace-sampler-arg RATIO] [--service-name NAME]
    iop-node example [NAME]      print a file the package ships (node.yaml, a systemd unit)

A Node needs only where its Edges are, who it is, and its token; everything else (its
providers) comes from the Edges. `--edge` may be given several times (Edge replicas:
one link each); `--edge-dns` links to every address a name resolves to. The token is
read from `--token-file` or else from the `IOP_NODE_TOKEN` environment variable, never
from the command line, so it does not show up in `ps` or shell history. A token file must
not be readable by every user, and may end in a newline; under systemd it is a credential
(`LoadCredential=`, read from `%d/NAME`, see `iop-node example iop-node.service`). The
optional YAML
file holds the same fields (`edge` and `edge_dns`, each a URL or a list of them,
`node_id`, `token_file`, and `telemetry` as the Edge config's `edge.telemetry`); command-line
flags win over it, and a relative `token_file` is relative to the YAML file.

Traces (design §16) are off unless an OTLP/HTTP endpoint is given (`--otlp-endpoint`, the
file's `telemetry.endpoint`, or the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT`); the other `--otlp-*`/`--trace-*` flags, and their
`OTEL_*` variables, say how (`schemas.runtime.telemetry`). Tracing needs
`pip install 'iop-gateway[otel]'`.

Exit codes: 0 after a stop by SIGTERM, 130 after Ctrl-C (SIGINT, as a shell reports an
interrupted command), 2 for a usage or configuration error, 3 when the Edge refused this
Node for good (bad token, unknown node id, protocol version, another Node with the same
id; after a few tries).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final, get_args
from urllib.parse import urlsplit

import msgspec
import trio
import yaml

from iop_node import __version__
from iop_node.examples import EXAMPLES, read_example
from iop_node.main import serve_until_signalled
from iop_node.tracing import NodeTracing, node_tracing
from iop_node.uplink.link import EdgeRejected
from schemas.config import OtlpProtocol, TelemetrySection, TraceSampler
from schemas.runtime import safe_yaml
from schemas.runtime.log_lines import LOG_FORMATS, LOG_LEVELS, LogFormat
from schemas.runtime.log_lines import configure_logging as configure_log_lines
from schemas.runtime.stop_signal import EXIT_INTERRUPTED
from schemas.runtime.telemetry import OTEL_EXTRA, TelemetryError, endpoint_problem

if TYPE_CHECKING:  # the adapter's module is imported when a cli provider is built
    from iop_node.adapters.cli import AllowedCommands

TOKEN_ENV_VAR = "IOP_NODE_TOKEN"
#: A token is a line; a token file far larger is the wrong file.
MAX_TOKEN_FILE_BYTES: Final = 4096
EXIT_USAGE = 2
EXIT_REJECTED = 3

log = logging.getLogger("iop_node")


class NodeFileConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The optional `--config` YAML: the same fields as the flags, typos rejected."""

    edge: str | list[str] | None = None
    edge_dns: str | list[str] | None = None
    node_id: str | None = None
    token_file: str | None = None
    allow_commands: list[str | list[str]] | None = None
    telemetry: TelemetrySection | None = None


@dataclass(frozen=True, slots=True)
class NodeInvocation:
    """What `iop-node run` resolved to; the token stays out of `repr`."""

    edge_urls: tuple[str, ...]
    node_id: str
    token: str = field(repr=False)
    edge_dns: tuple[str, ...] = ()
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    """The trace settings from the flags and the `--config` file (flags win)."""
    allowed_commands: AllowedCommands = frozenset()
    """The command lines the Edge's `cli` providers may run here (`iop_node.adapters.cli`)."""

    @property
    def edge_url(self) -> str:
        """The first Edge URL (or DNS URL): where a single-Edge Node connects."""
        return (self.edge_urls or self.edge_dns)[0]


class UsageError(Exception):
    """A problem with the invocation, reported as `iop-node: error: ...` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop-node",
        description="IOP Node: dials out to an IOP Edge and executes its runs.",
    )
    parser.add_argument("--version", action="version", version=f"iop-node {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="connect to the Edge and serve runs until stopped",
        description=(
            f"Connect to the Edge and serve runs. The token comes from --token-file or the "
            f"{TOKEN_ENV_VAR} environment variable. SIGINT/SIGTERM drain and stop; a second "
            "signal stops at once."
        ),
    )
    run.add_argument(
        "--edge",
        metavar="URL",
        action="append",
        help="an Edge's node listener (its edge.listen), ws://HOST:PORT or wss://HOST:PORT; "
        "repeat for several Edges",
    )
    run.add_argument(
        "--edge-dns",
        metavar="URL",
        action="append",
        help="link to every address this URL's host name resolves to (re-resolved every "
        "30 s; repeatable)",
    )
    run.add_argument(
        "--node-id", metavar="ID", help="this node's id: a nodes[].id in the Edge config"
    )
    run.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the node token, readable by this user only, e.g. a systemd "
        f"credential (relative to the current directory); default: the {TOKEN_ENV_VAR} "
        "environment variable",
    )
    run.add_argument(
        "--allow-command",
        metavar="COMMAND_LINE",
        action="append",
        help="a command line the Edge's cli providers may run on this machine, exactly "
        "as their adapter.command gives it, {model} included, e.g. 'llm -m {model}' "
        "(repeatable; none by default)",
    )
    run.add_argument(
        "--config",
        metavar="FILE",
        help="YAML with edge, node_id, token_file, allow_commands (`iop-node example "
        "node.yaml`); flags win over it, and its token_file is relative to the YAML file",
    )
    run.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="logging verbosity (default: info)",
    )
    run.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text: readable lines; json: one JSON object per line (default: text)",
    )
    traces = run.add_argument_group(
        "traces",
        "OpenTelemetry traces, off unless an endpoint is set here, in --config's telemetry "
        "or in OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT; a flag wins over its OTEL_* variable. "
        f"Needs pip install '{OTEL_EXTRA}'.",
    )
    traces.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="OTLP/HTTP receiver: base URL (http://collector:4318) or the full /v1/traces URL",
    )
    traces.add_argument(
        "--otlp-protocol",
        choices=get_args(OtlpProtocol),
        help="OTLP protocol (default: OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf)",
    )
    traces.add_argument(
        "--trace-sampler",
        metavar="NAME",
        choices=get_args(TraceSampler),
        help="sampler, as OTEL_TRACES_SAMPLER (default: parentbased_always_on: the Edge's "
        "decision is kept); one of " + ", ".join(get_args(TraceSampler)),
    )
    traces.add_argument(
        "--trace-sampler-arg",
        metavar="RATIO",
        type=_ratio,
        help="the ratio of the *traceidratio samplers, 0 to 1 (as OTEL_TRACES_SAMPLER_ARG)",
    )
    traces.add_argument(
        "--service-name",
        metavar="NAME",
        help="service.name of the Node's spans (default: OTEL_SERVICE_NAME, else iop-node)",
    )
    example = commands.add_parser(
        "example",
        help="print a file the package ships (node.yaml, a systemd unit); none: list them",
        description="Print one of the files the package ships for Nodes: the commented "
        "--config file, a systemd unit. Without NAME, list them.",
    )
    example.add_argument("name", nargs="?", metavar="NAME", help="the file to print")
    return parser


def resolve_invocation(args: argparse.Namespace, environ: Mapping[str, str]) -> NodeInvocation:
    """Merge flags, the optional YAML file and the environment; raise `UsageError`."""
    file_config = NodeFileConfig()
    config_dir = Path.cwd()
    if args.config:
        config_path = Path(args.config)
        file_config = _load_file_config(config_path)
        config_dir = config_path.parent

    edge_urls = tuple(args.edge or _as_list(file_config.edge))
    edge_dns = tuple(args.edge_dns or _as_list(file_config.edge_dns))
    node_id = args.node_id or file_config.node_id
    if not edge_urls and not edge_dns:
        raise UsageError("no Edge url: pass --edge ws://HOST:PORT (or `edge` in --config)")
    for flag, urls in (("--edge", edge_urls), ("--edge-dns", edge_dns)):
        edges = [_edge_address(flag, url) for url in urls]
        if len(set(edges)) != len(edges):
            raise UsageError(f"the same {flag} url is given twice (however it is spelt)")
    if not node_id:
        raise UsageError("no node id: pass --node-id ID (or `node_id` in --config)")

    if args.token_file:
        token = _read_token_file(Path(args.token_file))
    elif file_config.token_file:
        token = _read_token_file(config_dir / file_config.token_file)
    else:
        token = environ.get(TOKEN_ENV_VAR, "").strip()
        if not token:
            raise UsageError(f"no node token: set {TOKEN_ENV_VAR} or pass --token-file FILE")
    return NodeInvocation(
        edge_urls=edge_urls,
        node_id=node_id,
        token=token,
        edge_dns=edge_dns,
        telemetry=_telemetry(args, file_config.telemetry or TelemetrySection()),
        allowed_commands=_allowed_commands(args.allow_command or file_config.allow_commands or []),
    )


def _allowed_commands(lines: list[str] | list[str | list[str]]) -> AllowedCommands:
    """Each allowed command line as an argv: a string is split as a shell splits it, a
    list (in the config file) is the argv itself."""
    allowed: set[tuple[str, ...]] = set()
    for line in lines:
        if isinstance(line, str):
            try:
                argv = shlex.split(line)
            except ValueError as exc:
                raise UsageError(f"--allow-command {line!r}: {exc}") from None
        else:
            argv = line
        if not argv or not argv[0]:
            raise UsageError(f"--allow-command {line!r} names no program")
        allowed.add(tuple(argv))
    return frozenset(allowed)


def _edge_address(flag: str, url: str) -> tuple[str, str, int, str]:
    """Where `url` dials: scheme, host, port and path, as the link reads it
    (`uplink.dial`), so one Edge spelt two ways is one; raises `UsageError` naming `flag`
    for a url the link could not dial."""
    if not url.startswith(("ws://", "wss://")):
        raise UsageError(f"{flag} must be a ws:// or wss:// url, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number, an unclosed [IPv6 literal
        raise UsageError(f"{flag} {url!r} is not a url: {exc}") from None
    if not parts.hostname:
        raise UsageError(f"{flag} {url!r} names no host: ws://HOST:PORT")
    default = 443 if parts.scheme == "wss" else 80
    return parts.scheme, parts.hostname, port or default, parts.path or "/"


#: How the operator spells each trace setting (error messages name it).
TELEMETRY_FLAGS: Final = {
    "endpoint": "--otlp-endpoint",
    "protocol": "--otlp-protocol",
    "sampler": "--trace-sampler",
    "sampler_arg": "--trace-sampler-arg",
    "service_name": "--service-name",
}


def _telemetry(args: argparse.Namespace, from_file: TelemetrySection) -> TelemetrySection:
    """The `--config` file's telemetry with every flag given put over it."""
    given = {
        name: value
        for name, flag in TELEMETRY_FLAGS.items()
        if (value := getattr(args, flag.removeprefix("--").replace("-", "_"), None)) is not None
    }
    if given.get("endpoint") is not None:
        problem = endpoint_problem(given["endpoint"])
        if problem is not None:
            raise UsageError(f"--otlp-endpoint: {problem}")
    if from_file.endpoint is not None and "endpoint" not in given:
        problem = endpoint_problem(from_file.endpoint)
        if problem is not None:
            raise UsageError(f"--config telemetry.endpoint: {problem}")
    return msgspec.structs.replace(from_file, **given)


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ratio from 0 to 1")
    return value


def start_node_tracing(
    invocation: NodeInvocation, environ: Mapping[str, str]
) -> NodeTracing | None:
    """The Node's tracing, or None when off; raises `UsageError` saying what is wrong (a
    bad setting, or the SDK missing)."""
    try:
        return node_tracing(
            invocation.telemetry,
            environ,
            node_id=invocation.node_id,
            version=__version__,
            names=TELEMETRY_FLAGS,
        )
    except TelemetryError as exc:
        raise UsageError(str(exc)) from None


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


#: Libraries on the run path and the least severe level of theirs we show. The websocket
#: library logs every frame at debug level, too much even for debugging; httpx2 logs one
#: INFO line per upstream request (a measurable share of a Node's CPU per run, and noise:
#: the Edge already records every run), httpcore2 every protocol event at debug. Their
#: warnings and errors still come through.
QUIET_LOGGERS: Final[Mapping[str, int]] = {
    "trio-websocket": logging.INFO,
    "httpx2": logging.WARNING,
    "httpcore2": logging.WARNING,
}


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    configure_log_lines(level, log_format, QUIET_LOGGERS)


def main(argv: list[str] | None = None) -> int:
    """The `iop-node` console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors (and --help) by exiting
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == "example":
        return print_example(args.name)
    if args.command != "run":
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        invocation = resolve_invocation(args, os.environ)
        tracing = start_node_tracing(invocation, os.environ)
    except UsageError as exc:
        print(f"iop-node: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(args.log_level, args.log_format)
    if tracing is not None:
        log.info("traces: exported to %s", tracing.endpoint)
    try:
        status = trio.run(
            partial(
                serve_until_signalled,
                invocation.edge_urls,
                invocation.node_id,
                invocation.token,
                edge_dns=invocation.edge_dns,
                tracing=tracing,
                allowed_commands=invocation.allowed_commands,
            )
        )
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        return EXIT_INTERRUPTED
    except EdgeRejected as exc:
        if args.log_format == "json":  # the log shipper hears it too
            log.error("%s", exc)
        print(f"iop-node: error: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    log.info("iop-node stopped")
    return status


def print_example(name: str | None) -> int:
    """`iop-node example [NAME]`: print a shipped file, or list them."""
    if name is None:
        width = max(map(len, EXAMPLES))
        for example, what in EXAMPLES.items():
            print(f"{example:<{width}}  {what}")
        print("\n`iop-node example NAME > FILE` writes one; `iop-edge example` lists the Edge's.")
        return 0
    try:
        text = read_example(name)
    except KeyError:
        print(
            f"iop-node: error: no example {name!r}; there are: {', '.join(EXAMPLES)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sys.stdout.write(text)
    return 0


def _load_file_config(path: Path) -> NodeFileConfig:
    try:
        raw = safe_yaml.load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path} is not UTF-8 (byte offset {exc.start})") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path} is not valid YAML: {exc}") from None
    try:
        return msgspec.convert(raw or {}, NodeFileConfig)
    except msgspec.ValidationError as exc:
        raise UsageError(f"--config {path}: {exc}") from None


def _read_token_file(path: Path) -> str:
    """The token in `path`: one word, surrounding whitespace (a trailing newline) dropped.

    A file every user can read gives the token to every user of the host: refused, as
    ssh refuses such a private key. A systemd credential (`LoadCredential=`) is 0400 and
    owned by the service's user, so it passes."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):  # a folder, or a pipe that would block the read
            raise UsageError(f"token file {path} is not a regular file")
        with path.open("rb") as file:
            data = file.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if mode & stat.S_IROTH:
        raise UsageError(
            f"token file {path} can be read by every user of this host (mode "
            f"{stat.S_IMODE(mode):o}); make it private: chmod 600 {path}"
        )
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise UsageError(
            f"token file {path} is larger than a token can be ({MAX_TOKEN_FILE_BYTES} bytes)"
        )
    try:
        token = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"token file {path} is not UTF-8 text") from None
    if not token:
        raise UsageError(f"token file {path} is empty: put the node's token in it")
    if len(token.split()) > 1:
        raise UsageError(f"token file {path} holds more than one word; a token is one")
    return token
