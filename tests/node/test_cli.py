"""`iop-node run` argument handling (`iop_node.cli`): where the Edge, id and token come from."""

from __future__ import annotations

from pathlib import Path

import pytest

from iop_node.cli import (
    TOKEN_ENV_VAR,
    NodeInvocation,
    UsageError,
    build_parser,
    main,
    resolve_invocation,
)

EDGE = "ws://127.0.0.1:7700"
TOKEN = "s3cret-node-token"


def _resolve(argv: list[str], environ: dict[str, str] | None = None) -> NodeInvocation:
    return resolve_invocation(build_parser().parse_args(["run", *argv]), environ or {})


def test_flags_and_token_from_the_environment() -> None:
    invocation = _resolve(["--edge", EDGE, "--node-id", "gpu1"], {TOKEN_ENV_VAR: f" {TOKEN}\n"})
    assert invocation == NodeInvocation(edge_url=EDGE, node_id="gpu1", token=TOKEN)
    assert TOKEN not in repr(invocation)


def test_token_file_wins_over_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    invocation = _resolve(
        ["--edge", EDGE, "--node-id", "gpu1", "--token-file", str(token_file)],
        {TOKEN_ENV_VAR: "from-env"},
    )
    assert invocation.token == TOKEN


def test_yaml_config_with_relative_token_file(tmp_path: Path) -> None:
    (tmp_path / "node.token").write_text(TOKEN)
    config = tmp_path / "node.yaml"
    config.write_text(f"edge: {EDGE}\nnode_id: gpu1\ntoken_file: node.token\n")
    assert _resolve(["--config", str(config)]) == NodeInvocation(
        edge_url=EDGE, node_id="gpu1", token=TOKEN
    )
    # Flags win over the file.
    overridden = _resolve(["--config", str(config), "--node-id", "gpu2"])
    assert overridden.node_id == "gpu2"


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
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    with pytest.raises(UsageError, match="is empty"):
        _resolve(["--edge", EDGE, "--node-id", "a", "--token-file", str(token_file)])


def test_yaml_typos_and_bad_yaml_are_errors(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(f"edge: {EDGE}\nnode: gpu1\n")
    with pytest.raises(UsageError, match="node"):
        _resolve(["--config", str(config)])
    config.write_text("edge: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML"):
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
