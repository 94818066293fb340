"""llama.cpp's server tests for Messages and Responses (`llama_cpp_suite`), run against a
real Edge and Node in front of the sim (every run translated), of llama.cpp's own server
(relayed natively) and of that server declared chat-only (translated with a real model).

The suite runs in a child pytest, in its external-server mode, against the Edge this
test serves; each case that applies must pass, and the cases the table deselects must
still exist in the suite (a table of stale names would hide nothing)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.e2e.stack import edge_config, sim_provider, start_stack
from tests.suites.conftest import SERVED
from tests.suites.llama_cpp_suite import (
    BACKENDS,
    FILES,
    NOT_APPLICABLE,
    Backend,
    deselected,
    outcomes,
)

#: The model names the suite asks for; each is a catalog model of the one provider.
MODELS = ("test", "gpt-4.1")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def _provider(backend: Backend, request: pytest.FixtureRequest) -> tuple[dict[str, Any], str]:
    if backend == "sim":
        return sim_provider("p1", capacity=4), "sim-small"
    adapter: dict[str, Any] = {
        "base_url": request.getfixturevalue("llama_server"),
        "request_timeout_s": 600.0,
        "first_byte_timeout_s": 300.0,
    }
    if backend == "llama-server-translated":
        adapter["protocols"] = ["chat"]
    return {
        "id": "p1",
        "type": "vllm",
        "models": [SERVED],
        "capacity": 2,
        "adapter": adapter,
    }, SERVED


# A real model generates for every case: many minutes on a loaded 2-core machine.
@pytest.mark.suites
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_llama_cpp_server_tests_pass_through_iop(
    backend: Backend,
    llama_cpp_tests: Path,
    request: pytest.FixtureRequest,
    nursery: trio.Nursery,
    tmp_path: Path,
) -> None:
    provider, served = _provider(backend, request)
    text = edge_config(
        tmp_path / "state",
        providers=[provider],
        models=[{"id": name, "providers": {"p1": served}} for name in MODELS],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=MODELS)
    port = stack.addresses.openai_url.rsplit(":", 1)[1]
    skipped = deselected(backend)
    junit = tmp_path / "junit.xml"
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
        "-p", "no:randomly", "-o", "addopts=", f"--junitxml={junit}", *FILES,
        *(f"--deselect={file}::{case}" for case in skipped for file in FILES),
    ]  # fmt: skip
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": port, "NO_COLOR": "1"}
    result = await trio.run_process(
        command, cwd=llama_cpp_tests, env=env, check=False, capture_stdout=True, capture_stderr=True
    )
    (tmp_path / "suite.log").write_bytes(result.stdout + result.stderr)
    ran = outcomes(junit)
    failed = {case: outcome for case, outcome in ran.items() if outcome != "passed"}
    assert not failed, (
        f"llama.cpp's cases through IOP ({backend}), log in {tmp_path} "
        f"(llama-server's: {tmp_path.parent / 'llama-server.log'}): {failed}"
    )
    collected = set(ran) | set(skipped)
    assert set(NOT_APPLICABLE) <= collected | _cases_in(llama_cpp_tests)
    assert len(ran) >= 20, result.stdout[-2000:]  # the suite ran, not just its collection


def _cases_in(tests: Path) -> set[str]:
    """The test functions the suite's files define (parametrized ones by each id)."""
    names: set[str] = set()
    for file in FILES:
        source = (tests / file).read_text()
        for name in re.findall(r"^def (test_\w+)\(", source, re.MULTILINE):
            names.add(name)
            names.update({f"{name}[False]", f"{name}[True]"})
    return names


def test_the_docs_table_is_this_one() -> None:
    """docs/agents.md shows the deselected cases and why, as `NOT_APPLICABLE` says."""
    text = DOCS.read_text()
    rows = re.findall(r"^\| llama\.cpp \| `([^`]+)` \| ([^|]+) \| (.+) \|$", text, re.MULTILINE)
    table = {case: (backends.strip(), why.strip()) for case, backends, why in rows}
    assert set(table) == set(NOT_APPLICABLE), "docs/agents.md lists other llama.cpp cases"
    for case, (backends, why) in NOT_APPLICABLE.items():
        assert case in table, f"docs/agents.md does not list {case}"
        assert table[case] == (", ".join(backends), why), case
