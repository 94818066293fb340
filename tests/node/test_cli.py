"""`iop-node run` argument handling (`iop_node.cli`): where the Edge, id and token come from."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2
import msgspec
import pytest
import trio
import yaml

from iop_node import __version__
from iop_node.cli import (
    QUIET_LOGGERS,
    TOKEN_ENV_VAR,
    NodeFileConfig,
    NodeInvocation,
    UsageError,
    build_parser,
    configure_logging,
    main,
    resolve_invocation,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

EDGE = "ws://127.0.0.1:7700"
TOKEN = "s3cret-node-token"


def _resolve(argv: list[str], environ: dict[str, str] | None = None) -> NodeInvocation:
    return resolve_invocation(build_parser().parse_args(["run", *argv]), environ or {})


def _token_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_flags_and_token_from_the_environment() -> None:
    invocation = _resolve(["--edge", EDGE, "--node-id", "gpu1"], {TOKEN_ENV_VAR: f" {TOKEN}\n"})
    assert invocation == NodeInvocation(edge_urls=(EDGE,), node_id="gpu1", token=TOKEN)
    assert TOKEN not in repr(invocation)


def test_token_file_wins_over_the_environment(tmp_path: Path) -> None:
    token_file = _token_file(tmp_path / "token", TOKEN + "\n")
    invocation = _resolve(
        ["--edge", EDGE, "--node-id", "gpu1", "--token-file", str(token_file)],
        {TOKEN_ENV_VAR: "from-env"},
    )
    assert invocation.token == TOKEN


def test_yaml_config_with_relative_token_file(tmp_path: Path) -> None:
    _token_file(tmp_path / "node.token", TOKEN)
    config = tmp_path / "node.yaml"
    config.write_text(f"edge: {EDGE}\nnode_id: gpu1\ntoken_file: node.token\n")
    assert _resolve(["--config", str(config)]) == NodeInvocation(
        edge_urls=(EDGE,), node_id="gpu1", token=TOKEN
    )
    # Flags win over the file.
    overridden = _resolve(["--config", str(config), "--node-id", "gpu2"])
    assert overridden.node_id == "gpu2"


def test_several_edges_from_flags_or_the_file(tmp_path: Path) -> None:
    other = "ws://127.0.0.1:7710"
    env = {TOKEN_ENV_VAR: TOKEN}
    invocation = _resolve(["--edge", EDGE, "--edge", other, "--node-id", "gpu1"], env)
    assert invocation.edge_urls == (EDGE, other)
    config = tmp_path / "node.yaml"
    config.write_text(
        f"edge: [{EDGE}, {other}]\nedge_dns: ws://edges.internal:7700\nnode_id: gpu1\n"
    )
    invocation = _resolve(["--config", str(config)], env)
    assert invocation.edge_urls == (EDGE, other)
    assert invocation.edge_dns == ("ws://edges.internal:7700",)
    only_dns = _resolve(["--edge-dns", "ws://edges.internal:7700", "--node-id", "gpu1"], env)
    assert only_dns.edge_urls == () and only_dns.edge_url == "ws://edges.internal:7700"


def test_the_commands_cli_providers_may_run_come_from_flags_or_the_file(
    tmp_path: Path,
) -> None:
    env = {TOKEN_ENV_VAR: TOKEN}
    assert _resolve(["--edge", EDGE, "--node-id", "gpu1"], env).allowed_commands == frozenset()
    flags = ["--edge", EDGE, "--node-id", "gpu1", "--allow-command", "llm -m {model}"]
    invocation = _resolve([*flags, "--allow-command", "'/opt/my model/run' {model}"], env)
    assert invocation.allowed_commands == {
        ("llm", "-m", "{model}"),
        ("/opt/my model/run", "{model}"),
    }
    config = tmp_path / "node.yaml"
    config.write_text(
        f"edge: {EDGE}\nnode_id: gpu1\n"
        "allow_commands: ['llm -m {model}', [/opt/my model/run, '{model}']]\n"
    )
    assert _resolve(["--config", str(config)], env).allowed_commands == {
        ("llm", "-m", "{model}"),
        ("/opt/my model/run", "{model}"),
    }
    # Flags win over the file, as for every setting.
    overridden = _resolve(["--config", str(config), "--allow-command", "claude -p"], env)
    assert overridden.allowed_commands == {("claude", "-p")}
    for line, problem in (("", "names no program"), ("llm 'unclosed", "No closing quotation")):
        with pytest.raises(UsageError, match=problem):
            _resolve([*flags, "--allow-command", line], env)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--edge", EDGE, "--edge", EDGE], "the same --edge url is given twice"),
        (["--edge", "ws://Edge.local/", "--edge", "ws://edge.local:80"], "given twice"),
        (["--edge", "wss://e:443/", "--edge", "wss://e"], "the same --edge url is given twice"),
        (["--edge", "ws://127.0.0.1:abc"], "--edge 'ws://127.0.0.1:abc' is not a url"),
        (["--edge", "ws://[::1"], "--edge 'ws://\\[::1' is not a url"),
        (["--edge", "ws://:9000/"], "names no host"),
        (["--edge-dns", "http://edges.internal"], "--edge-dns must be a ws:// or wss:// url"),
        (["--edge-dns", "ws://edges.internal:x"], "--edge-dns .* is not a url"),
    ],
)
def test_bad_edge_lists(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        _resolve([*argv, "--node-id", "gpu1"], {TOKEN_ENV_VAR: TOKEN})


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--node-id", "gpu1"], {TOKEN_ENV_VAR: TOKEN}, "no Edge url"),
        (["--edge", EDGE], {TOKEN_ENV_VAR: TOKEN}, "no node id"),
        (["--edge", "http://x:1", "--node-id", "a"], {TOKEN_ENV_VAR: TOKEN}, "ws:// or wss://"),
        (["--edge", EDGE, "--node-id", "a"], {}, f"set {TOKEN_ENV_VAR} or pass --token-file"),
        (["--edge", EDGE, "--node-id", "a"], {TOKEN_ENV_VAR: "  "}, "no node token"),
        (["--edge", EDGE, "--node-id", "a", "--token-file", "/nonexistent/t"], {}, "cannot read"),
        (["--config", "/nonexistent/node.yaml"], {}, "cannot read --config"),
    ],
)
def test_usage_errors(argv: list[str], environ: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        _resolve(argv, environ)


def test_empty_token_file_is_an_error(tmp_path: Path) -> None:
    token_file = _token_file(tmp_path / "token", "\n")
    with pytest.raises(UsageError, match="is empty"):
        _resolve(["--edge", EDGE, "--node-id", "a", "--token-file", str(token_file)])


def test_a_systemd_credential_is_a_token_file(tmp_path: Path) -> None:
    """`LoadCredential=` puts a 0400 copy in `$CREDENTIALS_DIRECTORY`; the unit passes
    `--token-file %d/iop-node-token`, systemd's name for that folder."""
    credentials = tmp_path / "credentials"
    credentials.mkdir(mode=0o500)
    token_file = _token_file(credentials / "iop-node-token", TOKEN + "\n", mode=0o400)
    invocation = _resolve(["--edge", EDGE, "--node-id", "gpu1", "--token-file", str(token_file)])
    assert invocation.token == TOKEN


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (
            TOKEN,
            0o644,
            "can be read by every user of this host (mode 644); make it private: chmod 600",
        ),
        (TOKEN, 0o604, "can be read by every user"),
        (f"{TOKEN}\nsecond-line\n", 0o600, "holds more than one word"),
        ("x" * 5000, 0o600, "larger than a token can be"),
    ],
)
def test_a_token_file_that_is_not_one_private_token_is_refused(
    tmp_path: Path, content: str, mode: int, message: str
) -> None:
    token_file = _token_file(tmp_path / "token", content, mode)
    with pytest.raises(UsageError, match=re.escape(message)):
        _resolve(["--edge", EDGE, "--node-id", "a", "--token-file", str(token_file)])


def test_a_token_file_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is not a regular file"):
        _resolve(["--edge", EDGE, "--node-id", "a", "--token-file", str(tmp_path)])


def test_token_file_errors_reach_the_terminal_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = _token_file(tmp_path / "token", TOKEN, 0o644)
    assert main(["run", "--edge", EDGE, "--node-id", "a", "--token-file", str(token_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iop-node: error: token file {token_file} can be read by every user")
    assert TOKEN not in err


def test_example_lists_and_prints_the_shipped_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["example"]) == 0
    listing = capsys.readouterr().out
    assert "node.yaml" in listing and "iop-node.service" in listing
    assert main(["example", "iop-node.service"]) == 0
    unit = capsys.readouterr().out
    assert unit == (REPO_ROOT / "iop_node" / "examples" / "iop-node.service").read_text()
    assert "LoadCredential=iop-node-token:" in unit
    assert "--token-file %d/iop-node-token" in unit
    assert main(["example", "nope.yaml"]) == 2
    assert "no example 'nope.yaml'; there are: node.yaml, iop-node.service" in (
        capsys.readouterr().err
    )


def test_yaml_typos_and_bad_yaml_are_errors(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(f"edge: {EDGE}\nnode: gpu1\n")
    with pytest.raises(UsageError, match="node"):
        _resolve(["--config", str(config)])
    config.write_text("edge: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        _resolve(["--config", str(config)])
    config.write_text(f"edge: {EDGE}\nnode_id: gpu1\nedge: ws://127.0.0.1:1\n")
    with pytest.raises(UsageError, match="the key 'edge' is given twice"):
        _resolve(["--config", str(config)])


def test_missing_token_exits_2_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(TOKEN_ENV_VAR, raising=False)
    assert main(["run", "--edge", EDGE, "--node-id", "gpu1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("iop-node: error: no node token")
    assert TOKEN_ENV_VAR in error


def test_no_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "run" in capsys.readouterr().err


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--bogus"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    assert TOKEN_ENV_VAR in capsys.readouterr().out


def test_python_dash_m_runs_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "iop_node", "--version"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (result.returncode, result.stdout.strip()) == (0, f"iop-node {__version__}")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    names = ["", *QUIET_LOGGERS]
    levels = {name: logging.getLogger(name).level for name in names}
    handlers = list(root.handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("level", ["debug", "info", "warning"])
def test_logging_leaves_out_per_request_library_lines(level: str) -> None:
    configure_logging(level)
    # As in the real process (here pytest's handlers make `basicConfig` a no-op).
    logging.getLogger().setLevel(level.upper())
    httpx_log = logging.getLogger("httpx2")
    assert not httpx_log.isEnabledFor(logging.INFO)
    assert httpx_log.isEnabledFor(logging.WARNING)
    assert not logging.getLogger("httpcore2.http11").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("trio-websocket").isEnabledFor(logging.DEBUG)


@pytest.mark.usefixtures("restore_logging")
def test_an_upstream_request_logs_nothing_at_info(caplog: pytest.LogCaptureFixture) -> None:
    configure_logging("info")

    async def one_request() -> None:
        transport = httpx2.MockTransport(lambda request: httpx2.Response(200, content=b"{}"))
        async with httpx2.AsyncClient(transport=transport) as client:
            response = await client.post("http://upstream.test/v1/chat/completions")
            assert response.status_code == 200

    with caplog.at_level(logging.INFO):
        trio.run(one_request)
    assert [r for r in caplog.records if r.name.startswith(("httpx2", "httpcore2"))] == []


def test_example_node_config_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "iop_node" / "examples" / "node.yaml"
    loaded = msgspec.convert(yaml.safe_load(example.read_text()), NodeFileConfig)
    assert loaded.edge == "ws://127.0.0.1:7700" and loaded.node_id == "gpu1"


def test_a_permanent_rejection_exits_3_saying_what_to_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from iop_node.uplink.link import EdgeRejected

    async def rejected(
        edge_urls: list[str],
        node_id: str,
        token: str,
        *,
        edge_dns: list[str],
        tracing: None,
        allowed_commands: frozenset[tuple[str, ...]],
    ) -> None:
        assert allowed_commands == {("claude", "-p")}  # the flag reaches the Node
        raise EdgeRejected(edge_urls[0], node_id, "unknown_node", "node id 'gpu9' is not known", 3)

    monkeypatch.setattr("iop_node.cli.serve_until_signalled", rejected)
    argv = ["run", "--edge", EDGE, "--node-id", "gpu9", "--allow-command", "claude -p"]
    with monkeypatch.context() as env:
        env.setenv(TOKEN_ENV_VAR, TOKEN)
        assert main(argv) == 3
    err = capsys.readouterr().err
    assert err.startswith(
        f"iop-node: error: the Edge at {EDGE} refused node 'gpu9' 3 time(s): "
        "node id 'gpu9' is not known (unknown_node). To fix: add a nodes[] entry"
    )
    assert TOKEN not in err


def test_log_format_is_a_choice() -> None:
    args = build_parser().parse_args(["run", "--log-format", "json"])
    assert args.log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--log-format", "xml"])
