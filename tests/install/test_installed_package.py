"""The package as a user gets it: built as a wheel and as an sdist, each installed into a
fresh virtual environment from the registry with no dev extras, and run from a folder
outside the repository through its installed entry points only.

The commands are those of docs/install.md, run as written except where a test must
differ from a user: the configs listen on port 0 here (the commands then use the ports
the Edge logged), and a host's folders (/etc/iop, /etc/systemd/system, /usr/local/bin)
are temporary ones (the systemd units are checked with `systemd-analyze verify` and
their commands run as systemd would run them). `test_the_guide_has_no_command_untested`
keeps the guide and this file in step: a command added to the guide fails it until it is
run here, or listed with the few that need root on a systemd host.

Slow by design (a build and two installs): marked `install`, which `just test` leaves out
and `just test-install` runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from tests.install.user import (
    REPO,
    Installation,
    Shell,
    build_distributions,
    guide_commands,
    install,
    substitute,
)

pytestmark = pytest.mark.install

GUIDE = REPO / "docs" / "install.md"
#: The modules that need the `otel` extra (the OpenTelemetry SDK and OTLP exporter).
OTEL_MODULES = {"schemas.runtime.compat.otlp_http"}

# The guide's commands, as it writes them.
DIST = ".venv/bin/just dist"
INSTALL = "pipx install dist/iop_gateway-*.whl"
EDGE_VERSION = "iop-edge --version"
NODE_VERSION = "iop-node --version"
DEMO = "iop-edge demo --once --ephemeral-ports"
DEMO_COPY = "iop-edge example demo.yaml > my-demo.yaml"
EDGE_EXAMPLE = "iop-edge example edge.yaml"
INIT = "iop-edge init edge"
CHECK = "iop-edge check-config edge/edge.yaml"
SERVE = "cd edge && iop-edge serve --config edge.yaml"
SAVE_TOKEN = "(umask 077; cat > node-1.token)"
NODE_WITH_FILE = (
    "iop-node run --edge ws://127.0.0.1:7700 --node-id node-1 --token-file node-1.token"
)
READ_TOKEN = "read -rs IOP_NODE_TOKEN && export IOP_NODE_TOKEN"
NODE_WITH_ENV = "iop-node run --edge ws://127.0.0.1:7700 --node-id node-1"
REQUEST = (
    "curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' "
    """  -d '{"model": "sim-small", "messages": [{"role": "user", "content": "Hello!"}]}'"""
)
INIT_HOST = "iop-edge init /etc/iop"
EDGE_UNIT = "iop-edge example iop-edge.service > /etc/systemd/system/iop-edge.service"
MAKE_ETC = "mkdir -p /etc/iop"
SAVE_HOST_TOKEN = "(umask 077; cat > /etc/iop/node-1.token)"
NODE_UNIT = "iop-node example iop-node.service > /etc/systemd/system/iop-node.service"
EDGE_HOST = "sed -i 's/EDGE-HOST/edge.example.internal/' /etc/systemd/system/iop-node.service"
RUN_HERE = {
    DIST,  # by `distributions`, into a folder of its own (`just dist OUT`)
    INSTALL,  # as `pip install DISTRIBUTION` into a fresh venv: what pipx does
    EDGE_VERSION,
    NODE_VERSION,
    DEMO,
    DEMO_COPY,
    EDGE_EXAMPLE,
    INIT,
    CHECK,
    SERVE,
    SAVE_TOKEN,
    NODE_WITH_FILE,
    READ_TOKEN,
    NODE_WITH_ENV,
    REQUEST,
    INIT_HOST,
    EDGE_UNIT,
    MAKE_ETC,
    SAVE_HOST_TOKEN,
    NODE_UNIT,
    EDGE_HOST,
}
#: Commands for root on a host whose PID 1 is systemd, or for installing pipx itself.
#: What each does to IOP is run here another way: the global install is `INSTALL` with
#: other folders; daemon-reload and enable start the units' commands, as
#: `test_the_systemd_units_run_the_edge_and_a_node` does; reload, kill, stop and restart
#: send the signals that test sends.
HOST_ONLY = {
    "apt install pipx",
    "pipx ensurepath",
    "PIPX_HOME=/opt/pipx PIPX_BIN_DIR=/usr/local/bin pipx install dist/iop_gateway-*.whl",
    "iop-edge restart",  # what SIGUSR2 does, through the admin API
    "systemctl daemon-reload",
    "systemctl enable --now iop-edge",
    "systemctl enable --now iop-node",
    "systemctl reload iop-edge",
    "systemctl kill --kill-who=main -s SIGUSR2 iop-edge",
    "systemctl restart iop-edge",
    "systemctl stop iop-edge",
    "systemctl stop iop-node",
    "journalctl -u iop-node",
}
#: What the guide says to run once the package is on an index (it is not yet).
INDEX_ONLY = {"pipx install iop-gateway"}
LEDGER_URL = "postgresql://iop@127.0.0.1:5432/iop"
TOKEN_LINE = re.compile(r"^    (iop-node-[A-Za-z0-9_-]{43})$", re.MULTILINE)


def test_the_guide_has_no_command_untested() -> None:
    commands = guide_commands(GUIDE.read_text(encoding="utf-8"))
    assert set(commands) - RUN_HERE - HOST_ONLY - INDEX_ONLY == set()
    # nothing here the guide no longer says
    assert set(commands) >= RUN_HERE | HOST_ONLY | INDEX_ONLY


# --- the installations ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def distributions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_distributions(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module", params=["wheel", "sdist"])
def installed(
    request: pytest.FixtureRequest,
    distributions: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Installation:
    kind: str = request.param
    return install(kind, distributions[kind], tmp_path_factory.mktemp(f"venv-{kind}"))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """The user's folder: outside the repository, with no `configs/` in sight."""
    assert REPO not in tmp_path.parents
    return tmp_path


@pytest.fixture
def shell(installed: Installation, home: Path) -> Shell:
    return Shell(installed, home)


def _listen_anywhere(config: Path) -> None:
    """Port 0 for every listener of a config `init` wrote (the test picks no ports)."""
    text = config.read_text(encoding="utf-8")
    for port in ("7700", "7701", "8080"):
        assert f"127.0.0.1:{port} " in text
        text = text.replace(f"127.0.0.1:{port} ", "127.0.0.1:0 ")
    config.write_text(text, encoding="utf-8")


def _edit(config: Path, before: str, insert: str) -> None:
    """Insert a line before the one that starts with `before`."""
    text = config.read_text(encoding="utf-8")
    assert text.count(before) == 1
    config.write_text(text.replace(before, f"{insert}\n{before}"), encoding="utf-8")


def _token(init_output: bytes) -> str:
    match = TOKEN_LINE.search(init_output.decode())
    assert match, init_output.decode()
    return match.group(1)


def _completion(result: subprocess.CompletedProcess[bytes]) -> str:
    answer = json.loads(result.stdout)
    assert answer["model"] == "sim-small", answer
    content: str = answer["choices"][0]["message"]["content"]
    assert content, answer
    return content


# --- what the user runs -------------------------------------------------------------------


def test_the_distributions_carry_the_license_and_the_project_urls(
    distributions: dict[str, Path],
) -> None:
    license_text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    with zipfile.ZipFile(distributions["wheel"]) as wheel:
        names = wheel.namelist()
        (licensed,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
        assert wheel.read(licensed).decode() == license_text
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        fields = wheel.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in fields
    assert "License-File: LICENSE" in fields
    urls = dict(
        line.removeprefix("Project-URL: ").split(", ", 1)
        for line in fields.splitlines()
        if line.startswith("Project-URL: ")
    )
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues"}
    assert all(url.startswith("https://") for url in urls.values())
    with tarfile.open(distributions["sdist"]) as sdist:
        (member,) = [m for m in sdist.getmembers() if m.name.endswith("/LICENSE")]
        extracted = sdist.extractfile(member)
        assert extracted is not None
        assert extracted.read().decode() == license_text


async def test_installs_without_a_warning_and_declares_what_it_imports(
    installed: Installation, shell: Shell
) -> None:
    # pip's own settings on this machine (index folders that may be absent) are not ours.
    warnings = [
        line
        for line in installed.pip_output.splitlines()
        if "WARNING" in line and not re.search(r"Location '.*' is ignored", line)
    ]
    assert warnings == [], installed.pip_output
    await shell.run("python -m pip check")
    # Every module imports with the declared dependencies alone, but the PostgreSQL ones
    # (`*_postgres`), whose driver is the `postgres` extra, and the OTLP exporter's compat
    # module, which the `otel` extra brings (imported only when tracing is configured);
    # the SDK the tests use is not there either, and nothing needs it.
    modules = """
import importlib, json, pkgutil, iop_edge, iop_node, schemas
missing = {}
for package in (schemas, iop_edge, iop_node):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if module.name.endswith(".__main__"):  # runs the command
            continue
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            missing[module.name] = exc.name
print(json.dumps({"missing": missing, "at": iop_edge.__file__}))
"""
    result = json.loads((await shell.run(f"python - <<'PY'\n{modules}\nPY")).stdout)
    missing: dict[str, str] = result["missing"]
    assert "iop_edge.runtime.metering.usage_ledger.ledger_postgres" in missing
    extras = {name for name in missing if name.endswith("_postgres")} | OTEL_MODULES
    assert set(missing) == extras
    assert set(missing.values()) == {"psycopg", "opentelemetry"}
    assert result["at"].startswith(str(installed.venv))
    openai = await trio.run_process(
        ["bash", "-c", "python -c 'import openai'"],
        env=installed.environ(),
        capture_stderr=True,
        check=False,
    )
    assert openai.returncode == 1


async def test_version_demo_and_examples_from_any_folder(
    installed: Installation, shell: Shell, home: Path
) -> None:
    assert (await shell.run(EDGE_VERSION)).stdout == b"iop-edge 0.1.0\n"
    assert (await shell.run(NODE_VERSION)).stdout == b"iop-node 0.1.0\n"

    demo = (await shell.run(DEMO)).stdout.decode()
    assert "IOP demo is up (config: the built-in demo config" in demo
    assert re.search(r"< 24 chunks, model 'sim-small'", demo), demo

    await shell.run(DEMO_COPY)
    copy = (home / "my-demo.yaml").read_text(encoding="utf-8")
    assert copy == (REPO / "iop_edge" / "examples" / "demo.yaml").read_text(encoding="utf-8")
    example = (await shell.run(EDGE_EXAMPLE)).stdout
    (home / "example.yaml").write_bytes(example)
    await shell.run("iop-edge check-config example.yaml")


async def test_a_postgres_ledger_without_its_extra_names_the_extra(shell: Shell) -> None:
    await shell.run(INIT)
    _edit(shell.cwd / "edge" / "edge.yaml", "  state_dir: ./var", "  ledger: " + LEDGER_URL)
    result = await trio.run_process(
        ["bash", "-c", SERVE],
        cwd=shell.cwd,
        env=shell.installation.environ(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 1
    assert (
        "needs the psycopg package: pip install 'iop-gateway[postgres]'" in result.stderr.decode()
    )
    assert "Traceback" not in result.stderr.decode()


async def test_an_edge_and_a_node_serve_a_request_as_the_guide_runs_them(
    shell: Shell, home: Path
) -> None:
    init = await shell.run(INIT)
    token = _token(init.stdout)
    config = home / "edge" / "edge.yaml"
    assert token not in config.read_text(encoding="utf-8")
    assert (await shell.run(CHECK)).stdout.startswith(b"edge/edge.yaml: OK")
    refused = await trio.run_process(
        ["bash", "-c", INIT],
        cwd=home,
        env=shell.installation.environ(),
        check=False,
        capture_stdout=True,
        capture_stderr=True,
    )
    assert refused.returncode == 1 and b"init never overwrites a config" in refused.stderr
    _listen_anywhere(config)

    async with trio.open_nursery() as nursery:
        edge = await shell.start(nursery, SERVE)
        node_url = (await edge.wait_for(r"node websocket listening on (ws://\S+)")).group(1)
        openai_url = (await edge.wait_for(r"OpenAI API listening on (http://\S+)")).group(1)
        ports = {"ws://127.0.0.1:7700": node_url, "http://127.0.0.1:8080": openai_url}

        # The token, from init's output, through a private file.
        await shell.run(SAVE_TOKEN, stdin=f"{token}\n")
        assert stat.S_IMODE((home / "node-1.token").stat().st_mode) == 0o600
        node = await shell.start(nursery, substitute(NODE_WITH_FILE, ports))
        await edge.wait_for(r"node node-1 connected")
        _completion(await shell.run(substitute(REQUEST, ports)))
        assert await node.stop() == 0, node.log
        await edge.wait_for(r"node node-1 disconnected")

        # The token from the environment.
        from_env = f"{READ_TOKEN}\n{substitute(NODE_WITH_ENV, ports)}"
        node = await shell.start(nursery, from_env, stdin=f"{token}\n")
        await edge.wait_for(r"node node-1 connected", count=2)
        _completion(await shell.run(substitute(REQUEST, ports)))
        assert await node.stop() == 0, node.log

        assert await edge.stop() == 0, edge.log
    assert "Traceback" not in edge.log
    assert (home / "edge" / "var").is_dir()  # state_dir ./var, where serve started


# --- as systemd services --------------------------------------------------------------------


class ServiceManager:
    """What a `Type=notify` unit's `$NOTIFY_SOCKET` receives, one message a datagram."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.socket = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    async def receive(self) -> dict[str, str]:
        with trio.fail_after(60):
            data = await self.socket.recv(4096)
        return dict(line.split("=", 1) for line in data.decode().splitlines())


@pytest.fixture
async def service_manager() -> AsyncIterator[ServiceManager]:
    with tempfile.TemporaryDirectory(prefix="iop-notify-") as folder:  # a short socket path
        manager = ServiceManager(Path(folder) / "notify")
        await manager.socket.bind(str(manager.path))
        yield manager
        manager.socket.close()


@pytest.fixture
def host(home: Path) -> Iterator[dict[str, Path]]:
    """A host's folders, in the user's: where the guide's systemd section writes."""
    folders = {
        "etc": home / "host" / "etc" / "iop",
        "units": home / "host" / "etc" / "systemd" / "system",
        "state": home / "host" / "var" / "lib" / "iop-edge",
        "credentials": home / "host" / "run" / "credentials" / "iop-node.service",
    }
    for name in ("units", "state"):
        folders[name].mkdir(parents=True)
    yield folders


def _unit(path: Path) -> dict[str, str]:
    """A unit file's `Key=value` lines (the last of each key wins, as in systemd)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


async def _exited(pid: int) -> None:
    """Wait until a process that is not our child (a restart's successor) has exited."""
    descriptor = os.pidfd_open(pid)
    try:
        with trio.fail_after(60):
            await trio.lowlevel.wait_readable(descriptor)
    finally:
        os.close(descriptor)


async def test_the_systemd_units_run_the_edge_and_a_node(
    shell: Shell, host: dict[str, Path], service_manager: ServiceManager
) -> None:
    on_host = {
        "/etc/iop": str(host["etc"]),
        "/etc/systemd/system": str(host["units"]),
        "/usr/local/bin/": f"{shell.installation.bin}/",
    }
    init = await shell.run(substitute(INIT_HOST, on_host))
    token = _token(init.stdout)
    for command in (EDGE_UNIT, MAKE_ETC, NODE_UNIT, EDGE_HOST):
        await shell.run(substitute(command, on_host))
    await shell.run(substitute(SAVE_HOST_TOKEN, on_host), stdin=f"{token}\n")
    edge_unit_file, node_unit_file = (
        host["units"] / "iop-edge.service",
        host["units"] / "iop-node.service",
    )
    edge_unit, node_unit = _unit(edge_unit_file), _unit(node_unit_file)
    assert (edge_unit["Type"], edge_unit["NotifyAccess"]) == ("notify", "all")
    assert edge_unit["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert edge_unit["Restart"] == node_unit["Restart"] == "on-failure"
    assert edge_unit["StateDirectory"] == "iop-edge"
    assert node_unit["LoadCredential"] == "iop-node-token:/etc/iop/node-1.token"

    if shutil.which("systemd-analyze"):
        # As installed, but for where the commands are (`verify` checks they exist).
        for unit in (edge_unit_file, node_unit_file):
            unit.write_text(substitute(unit.read_text(encoding="utf-8"), on_host), "utf-8")
        verify = await trio.run_process(
            ["systemd-analyze", "verify", "--man=no", str(edge_unit_file), str(node_unit_file)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert verify.returncode == 0, verify.stderr.decode()

    # The Edge as systemd starts it: its ExecStart, in its WorkingDirectory (%S/iop-edge),
    # with $NOTIFY_SOCKET.
    _listen_anywhere(host["etc"] / "edge.yaml")
    async with trio.open_nursery() as nursery:
        edge = await shell.start(
            nursery,
            substitute(edge_unit["ExecStart"], on_host),
            cwd=host["state"],
            env={"NOTIFY_SOCKET": str(service_manager.path)},
        )
        assert await service_manager.receive() == {"READY": "1", "MAINPID": str(edge.process.pid)}
        node_url = (await edge.wait_for(r"node websocket listening on (ws://\S+)")).group(1)
        openai_url = (await edge.wait_for(r"OpenAI API listening on (http://\S+)")).group(1)
        ports = {"ws://edge.example.internal:7700": node_url, "http://127.0.0.1:8080": openai_url}

        # A Node as systemd starts it: LoadCredential= copies the token file into the
        # credentials folder (%d), readable by the service alone.
        host["credentials"].mkdir(parents=True, mode=0o500)
        credential = host["credentials"] / "iop-node-token"
        shutil.copyfile(host["etc"] / "node-1.token", credential)
        credential.chmod(0o400)
        node_command = substitute(node_unit["ExecStart"], {**on_host, **ports})
        node = await shell.start(
            nursery, node_command.replace("%d", str(host["credentials"])), cwd=Path("/")
        )
        await edge.wait_for(r"node node-1 connected")
        _completion(await shell.run(substitute(REQUEST, ports)))

        # `systemctl reload`: ExecReload, a live refresh from the edited file.
        config = host["etc"] / "edge.yaml"
        config.write_text(
            config.read_text(encoding="utf-8").replace("capacity: 4 ", "capacity: 6 "), "utf-8"
        )
        await shell.run(edge_unit["ExecReload"], env={"MAINPID": str(edge.process.pid)})
        await edge.wait_for(
            r"refresh apply of the config file \S+ from SIGHUP: applied, revision 1 -> 2, "
            r"1 change\(s\) \(1 live, 0 restart-required\)"
        )

        # SIGUSR2 to the main process: the successor tells systemd it is the main process.
        os.kill(edge.process.pid, signal.SIGUSR2)
        successor = int((await service_manager.receive())["MAINPID"])
        assert successor != edge.process.pid
        with trio.fail_after(60):
            assert await edge.process.wait() == 0, edge.log  # the old one drained and exited
        _completion(await shell.run(substitute(REQUEST, ports)))

        # `systemctl stop`: SIGTERM; the Edge says it is stopping and drains.
        assert await node.stop() == 0, node.log
        os.kill(successor, signal.SIGTERM)
        assert await service_manager.receive() == {"STOPPING": "1"}
        await _exited(successor)
    assert "Traceback" not in edge.log
    assert (host["state"] / "var").is_dir()  # state_dir ./var in the StateDirectory
