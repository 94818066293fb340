"""`iop-edge demo` runs its config file as written: an edited copy refreshes cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import yaml

from iop_edge.cli import main

REPO = Path(__file__).resolve().parents[2]


async def run_cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


async def test_an_edited_copy_of_the_demo_config_refreshes_without_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    demo = yaml.safe_load(
        (REPO / "iop_edge" / "examples" / "demo.yaml").read_text(encoding="utf-8")
    )
    demo["edge"]["state_dir"] = str(tmp_path / "var")
    copy = tmp_path / "my-demo.yaml"
    copy.write_text(yaml.safe_dump(demo, sort_keys=False), encoding="utf-8")

    command = [sys.executable, "-m", "iop_edge", "demo", "--config", str(copy)]
    process = await trio.lowlevel.open_process(
        [*command, "--ephemeral-ports", "--no-request"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        assert process.stdout is not None
        printed = ""
        with trio.fail_after(60):
            while not (match := re.search(r"admin API\s+(http://\S+)", printed)):
                chunk = await process.stdout.receive_some()
                assert chunk, f"the demo ended before printing its admin URL: {printed}"
                printed += chunk.decode()
        admin = match.group(1)

        # The demo runs the file as it is: nothing differs, no token change.
        assert await run_cli("refresh", "--admin", admin, "--config", str(copy)) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"dry run of {copy}: no changes")

        demo["nodes"][0]["providers"][1]["capacity"] = 6
        copy.write_text(yaml.safe_dump(demo, sort_keys=False), encoding="utf-8")
        assert await run_cli("refresh", "--admin", admin, "--config", str(copy), "--apply") == 0
        out = capsys.readouterr().out
        assert out.startswith(
            f"applied {copy}: 1 path(s) changed (1 live, 0 need a restart); revision 1 -> 2"
        )
        assert "token_hash" not in out
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await process.wait()
