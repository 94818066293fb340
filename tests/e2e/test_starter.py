"""`iop-edge init`, `iop-edge example` and the built-in demo: what a user who installed the
package (and has no repository) starts from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import trio
import yaml

from iop_edge.cli import main
from iop_edge.core.configuration.tokens import hash_token
from tests.e2e.stack import start_stack

REPO = Path(__file__).resolve().parents[2]
TOKEN_LINE = re.compile(r"^    (iop-node-[A-Za-z0-9_-]{43})$", re.MULTILINE)


def _init(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["init", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _token(out: str) -> str:
    match = TOKEN_LINE.search(out)
    assert match, out
    return match.group(1)


async def test_init_writes_a_config_that_serves_with_the_token_it_printed_once(
    nursery: trio.Nursery, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _init(capsys, str(tmp_path / "edge"))
    assert status == 0

    path = tmp_path / "edge" / "edge.yaml"
    token = _token(out)
    text = path.read_text(encoding="utf-8")
    assert out.count(token) == 1  # printed once, stored nowhere
    assert token not in text
    assert f"token_hash_sha256: {hash_token(token)}\n" in text
    assert path.stat().st_mode & 0o777 == 0o644  # hashes only: the service user reads it
    assert main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: OK — 1 model(s), 1 node(s)")

    # As written it serves `sim-small` through node-1, presenting the printed token.
    config = yaml.safe_load(text)
    assert (config["admin"]["listen"], config["openai"]["listen"]) == (
        "127.0.0.1:7701",
        "127.0.0.1:8080",
    )
    for section in ("edge", "admin", "openai"):
        config[section]["listen"] = "127.0.0.1:0"
    config["edge"]["state_dir"] = str(tmp_path / "var")
    stack = await start_stack(nursery, yaml.safe_dump(config), tmp_path / "run.yaml", nodes=())
    await stack.start_node("node-1", token)
    await stack.wait_servable("sim-small")
    client = openai.AsyncOpenAI(
        base_url=f"{stack.addresses.openai_url}/v1", api_key="unused", max_retries=0
    )
    completion = await client.chat.completions.create(
        model="sim-small", max_tokens=8, messages=[{"role": "user", "content": "Hello!"}]
    )
    assert completion.choices[0].message.content
    await client.close()


def test_init_prints_the_next_commands_for_that_file_and_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    status, out, _ = _init(capsys, "site", "--node-id", "gpu7")
    assert status == 0
    assert out.startswith("Wrote site/edge.yaml: node 'gpu7' serving model 'sim-small'")
    assert "  iop-edge check-config site/edge.yaml\n" in out
    assert "  cd site && iop-edge serve --config edge.yaml\n" in out
    assert "read -rs IOP_NODE_TOKEN && export IOP_NODE_TOKEN" in out
    assert "  iop-node run --edge ws://127.0.0.1:7700 --node-id gpu7\n" in out
    assert "curl -s http://127.0.0.1:8080/v1/chat/completions" in out
    config = yaml.safe_load((tmp_path / "site" / "edge.yaml").read_text(encoding="utf-8"))
    assert config["nodes"][0]["id"] == "gpu7"
    assert config["models"][0]["providers"] == {"gpu7-sim": "sim-small"}

    # Without DIR: this folder, and the commands need no `cd`.
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    status, out, _ = _init(capsys)
    assert status == 0
    assert "  iop-edge serve --config edge.yaml\n" in out
    assert (tmp_path / "here" / "edge.yaml").is_file()


def test_init_never_overwrites_a_config_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.yaml"
    assert _init(capsys, str(tmp_path))[0] == 0
    first = path.read_text(encoding="utf-8")

    status, out, err = _init(capsys, str(tmp_path))
    assert (status, out) == (1, "")
    assert err == (
        f"iop-edge: error: {path} exists; init never overwrites a config (it may hold the "
        "only record of tokens in use). Pick another folder, or pass --force to replace it\n"
    )
    assert path.read_text(encoding="utf-8") == first

    status, out, _ = _init(capsys, str(tmp_path), "--force")
    assert status == 0
    assert f"token_hash_sha256: {hash_token(_token(out))}" in path.read_text(encoding="utf-8")
    assert path.read_text(encoding="utf-8") != first
    assert [p.name for p in tmp_path.iterdir()] == ["edge.yaml"]  # no temporary file left


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node-id", "gpu 1"], "--node-id 'gpu 1': use letters, digits, '.', '_' and '-'"),
        (["--node-id=.x"], "starting with a letter or digit"),
    ],
)
def test_init_refuses_a_node_id_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, _, err = _init(capsys, str(tmp_path), *argv)
    assert status == 1 and message in err
    assert list(tmp_path.iterdir()) == []


def test_init_into_a_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("not a folder")
    status, _, err = _init(capsys, str(tmp_path / "taken"))
    assert status == 1 and f"{tmp_path / 'taken'} is not a folder" in err


def test_example_lists_and_prints_the_files_the_package_ships(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["example"]) == 0
    listing = capsys.readouterr().out
    for name in ("edge.yaml", "demo.yaml", "iop-edge.service"):
        assert re.search(rf"^{re.escape(name)} +\S", listing, re.MULTILINE), listing

    assert main(["example", "edge.yaml"]) == 0
    copy = tmp_path / "edge.yaml"
    copy.write_text(capsys.readouterr().out, encoding="utf-8")
    assert copy.read_text(encoding="utf-8") == (REPO / "iop_edge/examples/edge.yaml").read_text(
        encoding="utf-8"
    )
    assert main(["check-config", str(copy)]) == 0

    assert main(["example", "iop-edge.service"]) == 0
    unit = capsys.readouterr().out
    assert "ExecReload=/bin/kill -HUP $MAINPID\n" in unit
    assert "Type=notify\nNotifyAccess=all\n" in unit

    assert main(["example", "nope"]) == 1
    assert capsys.readouterr().err == (
        "iop-edge: error: no example 'nope'; there are: edge.yaml, demo.yaml, iop-edge.service\n"
    )


async def test_the_demo_runs_its_built_in_config_from_any_folder(tmp_path: Path) -> None:
    """No `configs/` folder here: the demo's config comes from the package."""
    result = await trio.run_process(
        [sys.executable, "-m", "iop_edge", "demo", "--once", "--ephemeral-ports"],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "IOP demo is up (config: the built-in demo config" in out
    assert "example demo.yaml > my-demo.yaml" in out
    assert re.search(r"< 24 chunks, model 'sim-small'", out), out
    assert (tmp_path / "var" / "demo").is_dir()  # state_dir ./var/demo, in this folder


async def test_a_refused_demo_request_is_one_error_line(tmp_path: Path) -> None:
    """The demo's request speaks plain HTTP; an error answer becomes a message, not a
    traceback (here: a copy whose model has a token limit below the demo's request)."""
    demo = yaml.safe_load((REPO / "iop_edge" / "examples" / "demo.yaml").read_text("utf-8"))
    demo["edge"]["state_dir"] = str(tmp_path / "var")
    demo["models"][0]["generation"] = {"max_tokens_limit": 8}
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(demo, sort_keys=False), encoding="utf-8")
    demo_once = [sys.executable, "-m", "iop_edge", "demo", "--once", "--ephemeral-ports"]
    result = await trio.run_process(
        [*demo_once, "--config", str(config)],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    err = result.stderr.decode()
    assert result.returncode == 1, result.stdout.decode() + err
    assert "iop-edge: error: the example request failed: HTTP 400: " in err
    assert "Traceback" not in err
