"""Optional sampling profiles of the Edge and the Node while the bench drives them.

`py-spy record --pid` attaches to a running process from outside, so IOP runs exactly as
in the measured configuration (no profiler imported, no code changed). py-spy is not a
dependency: the bench looks for it on `PATH` and next to this interpreter, and notes its
absence otherwise. Each recorder is owned by a task in the caller's nursery; cancelling
it interrupts py-spy (SIGINT, as Ctrl-C would), which then writes its file.

Sampling runs in its own process and takes CPU from a 2-core machine, so the numbers of
a profiled run are for reading the profile, not for quoting.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Final

import trio

FORMATS: Final = ("flamegraph", "speedscope", "raw")
_SUFFIX: Final = {"flamegraph": "svg", "speedscope": "json", "raw": "txt"}
_RATE_HZ: Final = 250
#: How long py-spy may take to write its file once interrupted.
_WRITE_GRACE_S: Final = 30.0


def find_py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    if beside.is_file():
        return str(beside)
    return shutil.which("py-spy")


async def _interrupt(process: trio.Process) -> None:
    process.send_signal(signal.SIGINT)
    await trio.sleep(_WRITE_GRACE_S)
    process.kill()


async def start_profilers(
    nursery: trio.Nursery, py_spy: str, pids: Mapping[str, int], out_dir: Path, fmt: str
) -> list[Path]:
    """Attach one recorder per process in `pids` (name -> pid); return the output paths.

    The recorders sample until `nursery` is cancelled."""
    await trio.Path(out_dir).mkdir(parents=True, exist_ok=True)
    outputs: list[Path] = []
    for name, pid in pids.items():
        output = out_dir / f"{name}.{_SUFFIX[fmt]}"
        argv = [
            py_spy, "record", "--pid", str(pid), "--output", str(output), "--format", fmt,
            "--rate", str(_RATE_HZ), "--nonblocking",
        ]  # fmt: skip
        await nursery.start(
            partial(
                trio.run_process,
                argv,
                check=False,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                deliver_cancel=_interrupt,
            )
        )
        outputs.append(output)
    return outputs
