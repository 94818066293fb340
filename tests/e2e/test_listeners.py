"""The Edge's own listening sockets (`iop_edge.runtime.lifecycle.listeners`) and the handover's
bookkeeping of inherited ones (`iop_edge.runtime.lifecycle.handover`)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from iop_edge.cli import main
from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.runtime.lifecycle.handover import HANDOVER_ENV, Handover, HandoverFailed
from iop_edge.runtime.lifecycle.listeners import ListenerError, bind_listener
from tests.e2e.stack import one_sim_config


def _bind(role: str, text: str):  # type: ignore[no-untyped-def]
    return bind_listener(role, text, parse_listen_address(text))  # type: ignore[arg-type]


def test_replicas_share_the_caller_port_but_not_the_node_or_admin_port() -> None:
    first = _bind("openai", "127.0.0.1:0")
    port = first.port
    second = _bind("openai", f"127.0.0.1:{port}")  # SO_REUSEPORT: workers on one host
    assert second.port == port
    node = _bind("node", "127.0.0.1:0")
    with pytest.raises(ListenerError) as caught:
        _bind("node", f"127.0.0.1:{node.port}")
    assert str(caught.value).startswith(f"edge.listen 127.0.0.1:{node.port}: the port is in use")
    assert "--node-listen" in str(caught.value)
    admin = _bind("admin", "127.0.0.1:0")
    with pytest.raises(ListenerError, match="--admin-listen"):
        _bind("admin", f"127.0.0.1:{admin.port}")
    for listener in (first, second, node, admin):
        listener.close()


def test_a_successor_inherits_a_socket_only_for_the_same_configured_address() -> None:
    listener = _bind("openai", "127.0.0.1:0")
    node = _bind("node", "127.0.0.1:0")
    fds = {"openai": os.dup(listener.socket.fileno()), "node": os.dup(node.socket.fileno())}
    environ = {
        HANDOVER_ENV: json.dumps(
            {
                "control_fd": 99,
                "revision": 7,
                "predecessor": "host/41",
                "listeners": {
                    "openai": {"fd": fds["openai"], "listen": "127.0.0.1:0"},
                    "node": {"fd": fds["node"], "listen": "127.0.0.1:0"},
                },
            }
        )
    }
    handover = Handover.from_environ(environ)
    assert handover is not None and handover.revision == 7
    assert handover.predecessor == "host/41"  # its roster row, counted gone once we serve
    assert HANDOVER_ENV not in environ  # a restart of the successor builds its own
    assert handover.take_listener("openai", "127.0.0.1:0") == fds["openai"]
    assert handover.take_listener("node", "0.0.0.0:7700") is None  # the config moved it
    with pytest.raises(OSError):
        os.fstat(fds["node"])  # ... so the inherited socket was closed
    assert handover.take_listener("admin", "127.0.0.1:0") is None  # nothing inherited
    os.close(fds["openai"])
    listener.close()
    node.close()


def test_a_malformed_handover_is_refused() -> None:
    with pytest.raises(HandoverFailed, match=HANDOVER_ENV):
        Handover.from_environ({HANDOVER_ENV: "{not json"})
    assert Handover.from_environ({}) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--node-listen", "nonsense"],
            "argument --node-listen: nonsense: must be HOST:PORT",
        ),
        (
            ["--admin-listen", "0.0.0.0:7711"],
            "argument --admin-listen: 0.0.0.0:7711: the admin API listens on loopback "
            "addresses only",
        ),
    ],
)
def test_serve_checks_its_listen_overrides(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad listen flag is a usage error, as any bad flag value is: exit 2, with the
    command's `error:` line."""
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--config", "configs/edge.yaml", *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"iop-edge serve: error: {message}" in err


def test_two_listeners_moved_onto_one_port_are_named_by_their_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(one_sim_config(tmp_path / "state"))
    with socket.socket() as probe:  # a free port: the clash is found before any bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ["--node-listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{port}"]
    assert main(["serve", "--config", str(config), *flags]) == 1
    assert (
        f"--admin-listen 127.0.0.1:{port} is also --node-listen (127.0.0.1:{port}): each "
        "listener needs its own port"
    ) in capsys.readouterr().err
