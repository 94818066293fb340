"""`iop-edge` commands (design §10): check-config, hash-token, and catalog/refresh against a
running Edge. The blocking CLI runs in a worker thread while the stack serves in Trio."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import pytest
import trio
import yaml

from iop_edge.cli import main
from tests.e2e.stack import Stack, edge_config, sim_provider, start_stack

REPO = Path(__file__).resolve().parents[2]
CAPACITY_PATH = "nodes[node-1].providers[sim-a].capacity"


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables as a wide terminal shows them (rich folds cells at its default 80 columns)."""
    monkeypatch.setenv("COLUMNS", "200")


# --- check-config --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["edge.yaml", "demo.yaml"])
def test_check_config_accepts_the_shipped_configs(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = REPO / "iop_edge" / "examples" / name

    assert main(["check-config", str(path)]) == 0

    out = capsys.readouterr().out
    assert f"{path}: OK" in out
    assert "model(s)" in out and "provider(s)" in out


BROKEN = """\
edge: {id: e, listen: "127.0.0.1:99999"}
openai:
  long_context_threshold_tokens: 0
models:
  - id: m
    providers: {ghost: s}
nodes:
  - id: n
    token_hash_sha256: NOT-A-HASH
    providers:
      - {id: p1, type: sim, models: [s], capacity: 0, capacty: 2}
"""


def test_check_config_lists_every_error_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN, encoding="utf-8")

    assert main(["check-config", str(path)]) == 1

    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == f"{path}: 6 error(s)"
    for where in (
        "edge.listen:",
        "openai.long_context_threshold_tokens:",
        "models[0].providers.ghost:",
        "nodes[0].token_hash_sha256:",
        "nodes[0].providers[0].capacity:",
        "nodes[0].providers[0].capacty:",
    ):
        assert any(line.startswith(where) for line in lines[1:]), (where, err)


def test_check_config_of_a_missing_file_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-config", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read config file" in capsys.readouterr().err


# --- hash-token ----------------------------------------------------------------------------


def test_hash_token_prints_the_sha256_and_never_the_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    token = "s3cret-caller-token"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{token}\n"))

    assert main(["hash-token"]) == 0

    captured = capsys.readouterr()
    assert captured.out == hashlib.sha256(token.encode()).hexdigest() + "\n"
    assert token not in captured.out + captured.err


def test_hash_token_without_input_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["hash-token"]) == 2
    assert "no token" in capsys.readouterr().err


# --- catalog and refresh against a running Edge -------------------------------------------


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-a", capacity=4, lifecycle=["list_models"])],
        models=[{"id": "m", "display_name": "Model M [beta]", "providers": {"sim-a": "sim-small"}}],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


def _candidate(stack: Stack, tmp_path: Path, **provider: object) -> Path:
    doc = yaml.safe_load(stack.config_path.read_text(encoding="utf-8"))
    doc["nodes"][0]["providers"][0].update(provider)
    path = tmp_path / "candidate.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


async def test_catalog_prints_tables(
    stack: Stack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # a wide terminal: every column
    assert await run_cli("catalog", "--admin", stack.addresses.admin_url) == 0

    out = capsys.readouterr().out
    assert "Providers (revision 1)" in out and "Models" in out
    provider_row = next(line for line in out.splitlines() if "sim-a " in line and "node-1" in line)
    for cell in ("sim", "local_inference", "yes", "available", "0/4", "0.00", "list"):
        assert cell in provider_row, (cell, provider_row)
    model_row = next(line for line in out.splitlines() if "Model M [beta]" in line)  # no markup
    assert "sim-a -> sim-small" in model_row


async def test_catalog_fits_a_narrow_terminal(
    stack: Stack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert await run_cli("catalog", "--admin", stack.addresses.admin_url) == 0

    lines = capsys.readouterr().out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    provider_row = next(line for line in lines if line.startswith("│ sim-a "))
    for cell in ("available", "0/4"):  # the essential columns survive, unwrapped
        assert cell in provider_row, (cell, provider_row)


async def test_catalog_json_is_the_admin_document(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_cli("catalog", "--admin", stack.addresses.admin_url, "--json") == 0

    catalog = json.loads(capsys.readouterr().out)
    assert catalog == await stack.catalog()


async def test_admin_url_defaults_to_the_config_admin_listen(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load(stack.config_path.read_text(encoding="utf-8"))
    doc["admin"]["listen"] = stack.addresses.admin_url.removeprefix("http://")
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")

    assert await run_cli("catalog", "--config", str(config), "--json") == 0

    assert json.loads(capsys.readouterr().out)["revision"] == 1


async def test_refresh_dry_run_reads_the_edge_file(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_cli("refresh", *stack.admin_flags) == 0

    out = capsys.readouterr().out
    assert out.startswith(f"dry run of {stack.config_path.resolve()}: no changes; revision 1")
    assert "dry_run:" not in out  # the old "refresh dry_run: dry_run"
    assert stack.edge.snapshot.revision == 1


async def test_refresh_apply_prints_a_readable_report(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    candidate = _candidate(stack, tmp_path, capacity=6)

    assert await run_cli("refresh", *stack.admin_flags, "--candidate", str(candidate)) == 0
    dry = capsys.readouterr().out
    assert (
        dry.startswith(f"dry run of {candidate}: 1 path(s) would change") and CAPACITY_PATH in dry
    )
    assert stack.edge.snapshot.revision == 1

    assert (
        await run_cli("refresh", *stack.admin_flags, "--apply", "--candidate", str(candidate)) == 0
    )

    out = capsys.readouterr().out
    assert out.startswith(
        f"applied {candidate}: 1 path(s) changed (1 live, 0 need a restart); revision 1 -> 2"
    )
    change_row = next(line for line in out.splitlines() if CAPACITY_PATH in line)
    assert "live" in change_row
    node_row = next(line for line in out.splitlines() if "node-1" in line and "applied" in line)
    assert " 2 " in node_row
    assert "changed providers: sim-a" in out
    assert stack.edge.snapshot.revision == 2
    assert stack.edge.snapshot.providers["sim-a"].capacity == 6


async def test_refresh_json_is_the_report(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    candidate = _candidate(stack, tmp_path, priority=3)
    argv = ("refresh", *stack.admin_flags, "--candidate", str(candidate))

    assert await run_cli(*argv, "--json") == 0

    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == report["outcome"] == "dry_run"
    assert report["changes"] == [
        {"path": "nodes[node-1].providers[sim-a].priority", "class": "live"}
    ]
    assert report["nodes"] == [] and report["errors"] == []


async def test_refresh_attempts_are_logged_by_the_edge(
    stack: Stack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.runtime.refresh.refresh")
    candidate = _candidate(stack, tmp_path, capacity=6, adapter={"ttft_ms": 9})

    assert (
        await run_cli("refresh", *stack.admin_flags, "--apply", "--candidate", str(candidate)) == 1
    )
    assert await run_cli("refresh", *stack.admin_flags, "--apply") == 0

    lines = [r.getMessage() for r in caplog.records if r.name == "iop_edge.runtime.refresh.refresh"]
    assert lines[0] == (
        "refresh apply of inline candidate from admin API: rejected, revision 1 -> 1, "
        "3 change(s) (1 live, 2 restart-required)"
    )
    assert any(
        "changing this needs a restart (`iop-edge restart`, no downtime)" in line
        for line in lines[1:]
    )
    assert (
        f"refresh apply of the config file {stack.config_path} from admin API: no_change, "
        "revision 1 -> 2, 0 change(s) (0 live, 0 restart-required)"
    ) in lines


async def test_refused_refresh_exits_1_naming_the_paths(
    stack: Stack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="iop_edge.runtime.refresh.refresh")
    candidate = _candidate(stack, tmp_path, capacity=6, adapter={"ttft_ms": 9})
    adapter_path = "nodes[node-1].providers[sim-a].adapter"

    assert (
        await run_cli("refresh", *stack.admin_flags, "--apply", "--candidate", str(candidate)) == 1
    )

    out = capsys.readouterr().out
    assert " ".join(out.split()).startswith(
        f"refused {candidate} (HTTP 409): nothing was applied; revision 1 stays"
    )
    assert f"{adapter_path}.ttft_ms: changing this needs a restart" in out
    assert f"{adapter_path}.tokens_per_second: changing this needs a restart" in out
    assert "(with --allow-restart-required the live changes apply now" in out
    assert "allow_restart_required" not in out  # the flag's name, not the HTTP field's
    # How such a change is applied: a restart with no downtime, not a stop and a start.
    restart_hint = "2 change(s) need a restart: `iop-edge restart` applies them with no downtime"
    assert restart_hint in " ".join(out.split())
    assert stack.edge.snapshot.revision == 1

    argv = ("refresh", *stack.admin_flags, "--apply", "--allow-restart-required")
    assert await run_cli(*argv, "--candidate", str(candidate)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"applied {candidate}: 3 path(s) changed (1 live, 2 need a restart)")
    assert f"pending restart: {adapter_path}.tokens_per_second, {adapter_path}.ttft_ms" in out
    assert restart_hint in " ".join(out.split())
    logged = [r.getMessage() for r in caplog.records if r.name.endswith("refresh.refresh")]
    assert (
        "refresh: 2 change(s) wait for a restart: `iop-edge restart` (or SIGUSR2) applies "
        "them with no downtime"
    ) in logged


async def test_unreadable_candidate_and_unreachable_admin_fail_cleanly(
    stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.yaml"
    assert await run_cli("refresh", *stack.admin_flags, "--candidate", str(missing)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"iop-edge: error: cannot read the candidate {missing} (--candidate)")
    with trio.socket.socket() as unused:
        await unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        assert await run_cli("catalog", "--admin", f"http://127.0.0.1:{port}") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"iop-edge: error: cannot reach the admin API at http://127.0.0.1:{port}")
    assert "Is the Edge running? Pass --admin" in err
    for url, problem in (
        ("http://127.0.0.1:abc", "is not a URL: Port could not be cast"),
        ("http://[::1", "is not a URL: Invalid IPv6 URL"),
        ("http://:7701", "names no host"),
        ("127.0.0.1:7701", "must be a URL like http://127.0.0.1:7701"),
    ):
        assert await run_cli("catalog", "--admin", url) == 1
        assert problem in capsys.readouterr().err, url
