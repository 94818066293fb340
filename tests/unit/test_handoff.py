"""The restart's handoff channel (`runtime.lifecycle.handoff`) on a real socket pair:
connections arrive as sockets of their role, the per-minute counters as windows, and
what is not well formed is dropped (a stray descriptor closed), never a crash."""

from __future__ import annotations

import array
import os
import socket

import trio

from iop_edge.runtime.lifecycle.handoff import HandoffSender, handoff_pair, receive_handoff


async def test_connections_and_windows_go_over_and_garbage_is_dropped() -> None:
    ours, theirs = handoff_pair()
    windows = {f"p{index}": (float(index), 2.0 * index) for index in range(3000)}
    sender = HandoffSender(ours, lambda: windows)
    adopted: list[tuple[str, bytes]] = []
    carried: dict[str, tuple[float, float]] = {}
    left, right = socket.socketpair()
    stray_left, stray_right = socket.socketpair()
    try:
        assert sender.send_connection("openai", left)
        # Garbage: a counters message that is not JSON, one with bad entries, and a
        # descriptor riding on a message that is not a connection.
        ours.send(b"L{not json")
        ours.send(b'L{"alice": [1], "bob": "x", "carol": [true, 1], "dave": [2, 3.5]}')
        fds = array.array("i", [stray_left.fileno()])
        ours.sendmsg([b"Lnull"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        sender.send_windows()  # several messages: 3,000 principals
        sender.close()

        def adopt(role: str, connection: socket.socket) -> None:
            with connection:
                connection.sendall(b"hello from the successor")
                adopted.append((role, right.recv(100)))

        with trio.fail_after(5):
            await receive_handoff(theirs, adopt=adopt, carry_over=carried.update)
    finally:
        for sock in (left, right, stray_left):
            sock.close()
    assert adopted == [("openai", b"hello from the successor")]
    assert carried == {**windows, "dave": (2.0, 3.5)}
    assert sender.connections == 1
    # The stray descriptor the successor received was closed: its peer reads the end.
    stray_right.settimeout(5)
    assert stray_right.recv(1) == b""
    stray_right.close()
    assert theirs.fileno() == -1  # the channel is closed once the old Edge's end is


def test_a_send_to_a_successor_that_is_gone_fails_and_says_so() -> None:
    ours, theirs = handoff_pair()
    theirs.close()
    sender = HandoffSender(ours, dict)
    left, right = socket.socketpair()
    try:
        assert not sender.send_connection("openai", left)
        assert not sender.send_connection("openai", left)  # broken: not tried again
        assert os.get_inheritable(left.fileno()) is False  # untouched, still ours
    finally:
        for sock in (left, right):
            sock.close()
        sender.close()
