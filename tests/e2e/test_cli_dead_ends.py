"""`iop-edge` without dead ends: every way an operator got stuck, checked.

Commands that need a process of their own (a busy port, a closed pipe, a terminal) run as
subprocesses; the rest call `main()` in a worker thread while the stack serves in Trio.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from rich.console import Console

from iop_edge.cli import build_parser, config_lookup, main
from iop_edge.cli.console import render_catalog, render_usage, watch_catalog
from iop_edge.core.configuration.tokens import hash_token
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack

REPO = Path(__file__).resolve().parents[2]
IOP_EDGE = [sys.executable, "-m", "iop_edge"]


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


def _run(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*IOP_EDGE, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=kwargs.pop("cwd", REPO),
        **kwargs,
    )


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-a", capacity=4)],
        models=[{"id": "m", "providers": {"sim-a": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


# --- the parser ------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    found = [(parser.prog, action) for action in parser._actions]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _options(sub)
    return found


def test_every_option_has_help_text() -> None:
    missing = [
        f"{prog} {'/'.join(action.option_strings) or action.dest}"
        for prog, action in _options(build_parser())
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert missing == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == "iop-edge 0.1.0"


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_log_level_is_validated(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--log-level", "bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid log level 'bogus'; choose from debug, info, warning, error" in err


def test_log_level_ignores_case() -> None:
    args = build_parser().parse_args(["serve", "--log-level", "DEBUG", "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("debug", "json")


# --- output into a closed pipe (`| head`) ---------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["catalog", "--json"], ["catalog"], ["usage"], ["usage", "--json"]],
    ids=" ".join,
)
async def test_a_closed_pipe_ends_quietly(stack: Stack, command: list[str]) -> None:
    """JSON goes out with `print`, tables with rich (which exits 1 on a closed pipe unless
    told otherwise): both end with 141 and nothing on stderr."""

    def catalog_into_a_closed_pipe() -> tuple[int, str]:
        process = subprocess.Popen(
            [*IOP_EDGE, *command, "--admin", stack.addresses.admin_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # the reader (`head`) is gone before anything was written
        err = process.stderr.read().decode()
        return process.wait(timeout=60), err

    code, err = await trio.to_thread.run_sync(catalog_into_a_closed_pipe)
    assert (code, err) == (141, "")


# --- a busy port ------------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Any:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_busy_port_names_the_port_and_the_setting(tmp_path: Path, taken_port: int) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(
        edge_config(
            tmp_path / "var",
            providers=[sim_provider("sim-a")],
            models=[{"id": "m", "providers": {"sim-a": "sim-small"}}],
        ).replace("openai:\n  listen: 127.0.0.1:0", f"openai:\n  listen: 127.0.0.1:{taken_port}"),
        encoding="utf-8",
    )
    result = _run("serve", "--config", str(config), "--log-level", "error")

    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(
        f"iop-edge: error: openai.listen 127.0.0.1:{taken_port}: the port is in use"
    )
    assert f"set another port in openai.listen of {config}" in line


def test_a_busy_demo_port_suggests_ephemeral_ports(tmp_path: Path, taken_port: int) -> None:
    demo = yaml.safe_load(
        (REPO / "iop_edge" / "examples" / "demo.yaml").read_text(encoding="utf-8")
    )
    demo["edge"]["state_dir"] = str(tmp_path / "var")
    demo["edge"]["listen"] = "127.0.0.1:0"
    demo["openai"]["listen"] = "127.0.0.1:0"
    demo["admin"]["listen"] = f"127.0.0.1:{taken_port}"
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(demo), encoding="utf-8")

    result = _run("demo", "--once", "--config", str(config))

    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"admin.listen 127.0.0.1:{taken_port}: the port is in use" in result.stderr
    assert "Rerun with --ephemeral-ports" in result.stderr


# --- check-config applies every rule serve applies -----------------------------------------------


def _config_with(tmp_path: Path, **edge: Any) -> Path:
    doc = yaml.safe_load(
        edge_config(
            tmp_path / "var",
            providers=[sim_provider("sim-a")],
            models=[{"id": "m", "providers": {"sim-a": "sim-small"}}],
        )
    )
    doc["edge"].update(edge)
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("edge", "where", "problem"),
    [
        ({"state_dir": "{file}/var"}, "edge.state_dir:", "cannot be created"),
        ({"state_dir": "{file}"}, "edge.state_dir:", "exists and is not a directory"),
        (
            {"tls": {"cert_file": "{tmp}/missing.pem", "key_file": "{tmp}/missing.key"}},
            "edge.tls:",
            "cannot read",
        ),
    ],
)
async def test_check_config_refuses_what_serve_refuses(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edge: dict[str, Any],
    where: str,
    problem: str,
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory", encoding="utf-8")
    filled = yaml.safe_load(
        yaml.safe_dump(edge).replace("{file}", str(a_file)).replace("{tmp}", str(tmp_path))
    )
    path = _config_with(tmp_path, **filled)

    assert await run_cli("check-config", str(path)) == 1
    checked = capsys.readouterr().err
    assert "1 error(s)" in checked
    assert any(line.startswith(where) and problem in line for line in checked.splitlines())

    assert await run_cli("serve", "--config", str(path), "--log-level", "error") == 1
    served = capsys.readouterr().err
    assert served.startswith(f"iop-edge: error: {path}: invalid config")
    assert any(line.startswith(where) and problem in line for line in served.splitlines())


def test_the_public_demo_token_only_on_loopback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = (REPO / "iop_edge" / "examples" / "demo.yaml").read_text(encoding="utf-8")
    exposed = tmp_path / "exposed.yaml"
    exposed.write_text(demo.replace("listen: 127.0.0.1:7700", "listen: 0.0.0.0:7700"), "utf-8")
    assert main(["check-config", str(exposed)]) == 1
    err = capsys.readouterr().err
    assert "nodes[0].token_hash_sha256: is the hash of the public demo token" in err


# --- finding the admin API ---------------------------------------------------------------------


async def test_outside_the_repo_the_error_says_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        config_lookup, "DEFAULT_CONFIGS", (Path("edge.yaml"), tmp_path / "etc" / "edge.yaml")
    )
    assert await run_cli("catalog") == 1
    err = capsys.readouterr().err
    assert f"there is no ./edge.yaml nor {tmp_path}/etc/edge.yaml (./ is {tmp_path})" in err
    assert "--admin http://127.0.0.1:7701" in err and "--config" in err

    path = _config_with(tmp_path)  # the test configs listen on port 0
    assert await run_cli("usage", "--config", str(path)) == 1
    err = capsys.readouterr().err
    assert "admin.listen 127.0.0.1:0: the Edge picked a free port" in err
    assert "Pass --admin" in err


async def test_admin_errors_print_the_servers_message(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_cli("usage", "--admin", stack.addresses.admin_url, "--group-by", "colour") == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "iop-edge: error: the admin API answered HTTP 400: group_by: unknown column(s) colour"
    )
    assert "{'error'" not in err and '{"error"' not in err


async def test_an_admin_command_sent_to_another_port_says_where_the_admin_api_is(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    node = stack.addresses.node_url.replace("ws://", "http://")
    for url, says in ((stack.addresses.openai_url, "caller API"), (node, "node listener")):
        assert await run_cli("catalog", "--admin", url) == 1
        err = capsys.readouterr().err
        assert says in err and "admin API" in err and "Pass --admin" in err, err


# --- refresh: which file ---------------------------------------------------------------------


async def test_refresh_config_names_only_the_edge(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--config` locates the Edge; a refresh without `--candidate` re-reads the Edge's own
    file. Naming another file says so instead of silently comparing the Edge's."""
    doc = yaml.safe_load(stack.config_path.read_text(encoding="utf-8"))
    doc["admin"]["listen"] = stack.addresses.admin_url.removeprefix("http://")
    doc["nodes"][0]["providers"][0]["capacity"] = 9
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc), encoding="utf-8")

    assert await run_cli("refresh", "--config", str(other)) == 1
    err = capsys.readouterr().err
    assert f"the Edge runs {stack.config_path.resolve()}, not {other}" in err
    assert f"iop-edge refresh --candidate {other} [--apply]" in err

    # As told: --candidate alone finds the Edge through the candidate's admin.listen.
    assert await run_cli("refresh", "--candidate", str(other)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dry run of {other}: 2 path(s) would change")
    assert "nodes[node-1].providers[sim-a].capacity" in out


async def test_if_revision_conflict_names_the_flag(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ("refresh", *stack.admin_flags, "--apply", "--if-revision", "7")
    assert await run_cli(*argv) == 1
    out = capsys.readouterr().out
    assert "--if-revision: the running revision is 1, not 7" in out


# --- hash-token at a terminal ------------------------------------------------------------------


def test_hash_token_prompts_without_echo_at_a_terminal() -> None:
    token = "typed-at-a-terminal-not-shown"
    pid, fd = os.forkpty()
    if pid == 0:  # the child: iop-edge with the pty as its terminal
        os.execv(sys.executable, [*IOP_EDGE, "hash-token"])
    output = b""
    while b"token (not echoed): " not in output:
        output += os.read(fd, 1024)
    os.write(fd, token.encode() + b"\n")
    while True:
        try:
            chunk = os.read(fd, 1024)
        except OSError:  # EIO: the child exited and closed the terminal
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    text = output.decode()
    assert os.waitstatus_to_exitcode(status) == 0
    assert hash_token(token) in text
    assert token not in text


def test_hash_token_still_reads_a_pipe() -> None:
    result = subprocess.run(
        [*IOP_EDGE, "hash-token"],
        input="piped-token\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, hash_token("piped-token") + "\n")
    assert "token (not echoed)" not in result.stdout + result.stderr


# --- usage ---------------------------------------------------------------------------------------


async def test_usage_has_totals_and_a_status_breakdown(
    stack: Stack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    admin = stack.addresses.admin_url
    assert await run_cli("usage", "--admin", admin, "--since", "2000-01-01") == 0
    assert capsys.readouterr().out.startswith("no usage recorded from 2000-01-01 00:00:00 UTC")

    async with stack.client() as client:
        for tokens in (2, 3):
            await client.chat.completions.create(
                model="m", max_tokens=tokens, messages=[{"role": "user", "content": "x"}]
            )
    await stack.edge.ledger.wait_flushed()
    assert await run_cli("usage", "--admin", admin, "--group-by", "model") == 0

    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if "total" in line)
    cells = [cell.strip() for cell in total.split("│")[1:-1]]
    assert cells[0] == "total" and cells[1] == "2" and cells[3] == "5"  # 2 + 3 tokens
    assert "requests by status: 200: 2" in out


def test_usage_renders_columns_the_server_adds() -> None:
    console = Console(file=io.StringIO(), width=160)
    report = {
        "since": None,
        "until": None,
        "group_by": ["model"],
        "rows": [
            {
                "model": "m",
                "usage_source": "estimated",
                "requests": 1,
                "prompt_tokens": 5,
                "completion_tokens": 7,
            },
            {
                "model": "m",
                "usage_source": "provider",
                "requests": 2,
                "prompt_tokens": 1,
                "completion_tokens": 1,
            },
        ],
    }
    by_status = {"rows": [{"status": 499, "requests": 1}, {"status": 200, "requests": 2}]}
    render_usage(console, report, by_status)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "usage_source" in out and "estimated" in out
    assert "requests by status: 200: 2, 499: 1" in out


USAGE_AT_80 = {
    "since": None,
    "until": None,
    "group_by": ["principal_ref", "token_ref", "model"],
    "rows": [
        {
            "principal_ref": "evaluations-team",
            "token_ref": "nightly-batch-runner",
            "model": "Qwen/Qwen3.6-35B-A3B",
            "requests": 123456,
            "prompt_tokens": 987654321,
            "completion_tokens": 123456789,
            "estimated_requests": 12,
            "estimated_tokens": 3456,
        }
    ],
    "principals": {
        "principals": [
            {
                "principal_ref": "evaluations-team",
                "limited_by": "evaluations-*",
                "models": ["qwen*", "llama-3.1-8b"],
                "in_flight": 3,
                "max_concurrent": 4,
                "queued": 17,
                "requests_per_minute": 600,
                "requests_remaining": 598,
                "tokens_per_minute": 100000,
                "tokens_remaining": 99000,
                "tokens_today": 1234567,
                "tokens_per_day": 5000000,
                "rejected": {"rate_limit_requests": 4},
            }
        ]
    },
}


def test_usage_at_80_columns_leaves_whole_columns_out_and_names_them() -> None:
    """As the catalog does: every shown cell whole, what did not fit named (not cut)."""
    console = Console(file=io.StringIO(), width=80)
    render_usage(console, USAGE_AT_80)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out  # no cell cut short
    flat = "".join(out.split())  # a folded cell reads whole once the lines are joined
    for whole in ("evaluations-team", "nightly-batch-runner", "Qwen/Qwen3.6-35B-A3B", "123456"):
        assert whole in flat
    notes = [" ".join(n.split()) for n in out.split("not shown at 80 columns: ")[1:]]
    assert len(notes) == 2  # one per table that left columns out
    assert notes[0].startswith(
        "prompt tokens, completion tokens, cached tokens, estimated requests"
    )
    assert "(widen the terminal, or use --json)" in notes[0]
    # The principals table keeps its essentials and says what it left out.
    principals = out[out.index("Principals against their limits") :]
    assert "3/4" in principals and "limits" in notes[1] and "models" in notes[1]

    wide = Console(file=io.StringIO(), width=240)
    render_usage(wide, USAGE_AT_80)
    everything = wide.file.getvalue()  # type: ignore[attr-defined]
    assert "not shown" not in everything
    assert "987654321" in everything and "rate_limit_requests 4" in everything


# --- catalog -----------------------------------------------------------------------------------


def _provider(provider_id: str, **changes: Any) -> dict[str, Any]:
    return {
        "id": provider_id,
        "node_id": "gpu1",
        "type": "vllm",
        "category": "local_inference",
        "enabled": True,
        "connected": True,
        "health": "available",
        "health_reason": None,
        "capacity": 8,
        "in_flight": 3,
        "load_ratio": 0.375,
        "long_context_slots": 2,
        "long_in_flight": 1,
        "models": ["Qwen/Qwen3.6-35B-A3B"],
        "queued": 4,
        "priority": 10,
        **changes,
    }


CATALOG = {
    "revision": 3,
    "models": [{"id": "qwen", "display_name": "Qwen", "providers": {}, "queued": 4}],
    "providers": [
        _provider("gpu1-vllm"),
        _provider(
            "gpu2-vllm", connected=False, health="unavailable", health_reason="node disconnected"
        ),
        _provider(
            "gpu3-vllm",
            health="unavailable",
            health_reason="upstream refused the connection",
        ),
        _provider("gpu4-vllm", health="draining", health_reason="node is shutting down"),
    ],
}


def test_catalog_at_80_columns_says_why_and_what_it_left_out() -> None:
    console = Console(file=io.StringIO(), width=80)
    render_catalog(console, CATALOG)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    # A disconnected node and a down upstream read differently.
    row = {line.split("│")[1].strip(): line for line in lines if line.startswith("│ gpu")}
    assert "unavailable: node" in row["gpu2-vllm"]
    assert "unavailable: upstream refused" in row["gpu3-vllm"]
    assert "draining: node is shutting" in row["gpu4-vllm"]
    note = out[out.index("not shown at 80 columns:") :].replace("\n", "")
    assert "connected" in note and "lifecycle" in note and "--json" in note
    header = next(line for line in lines if "provider" in line and "health" in line)
    assert "queued" not in header  # a provider's waiting requests are its model's queue


def test_catalog_watch_redraws_in_place() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=True)
    served = [CATALOG, {**CATALOG, "revision": 4}]

    def fetch() -> dict[str, Any]:
        if not served:
            raise KeyboardInterrupt
        return served.pop(0)

    with pytest.raises(KeyboardInterrupt):
        watch_catalog(console, fetch, interval_s=0)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Providers (revision 3)" in out and "Providers (revision 4)" in out
    assert "\x1b[2K" in out and "\x1b[1A" in out  # erased and rewritten, not appended
