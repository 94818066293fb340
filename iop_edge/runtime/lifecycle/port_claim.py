"""Who else serves this caller port: only a replica of the same config may share it.

The caller listener sets `SO_REUSEPORT` so that replicas on one host share the port and
the kernel spreads callers across them (see `listeners`). The same option lets a second
Edge with a *different* config bind the port silently, and callers are then split between
two pools (one answers 404 for a model the other serves). So every Edge that binds a
caller port also claims it by name, and asks whoever holds the claim which config it runs.

Rules:
1. The claim is a Linux abstract-namespace Unix socket named after the bound caller
   address (`iop-edge caller 0.0.0.0:8080`). Abstract names live in the network namespace,
   as ports do, and vanish with the process that bound them, however it dies: there is no
   stale lock file to clean up.
2. The first Edge binds the name and answers each connection with one JSON line: its
   pid, instance, config sha256 and config path. It answers from a task of its own; the
   socket is the only state.
3. An Edge that finds the name taken connects and reads that line. The same config
   sha256: a replica, welcome. Another one: `PortShared`, naming the other process, and
   the Edge refuses to start. No answer within `ASK_TIMEOUT_S`: the holder is stuck or is
   not an Edge; refuse too, saying so (serving beside an unknown pool is the failure this
   module exists to prevent).
4. A restart successor inherits the caller socket and runs a new config by design: it
   does not ask. Every Edge that does not hold the name retries binding it while it
   serves, so a successor (or a replica) takes the claim over when its holder exits.
5. On other systems (no abstract namespace) there is no check: `claim` returns a claim
   that holds nothing.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass
from typing import Final

import msgspec
import trio

__all__ = [
    "ASK_TIMEOUT_S",
    "CallerPortClaim",
    "ClaimIdentity",
    "PortShared",
    "claim_name",
    "own_identity",
]

ASK_TIMEOUT_S: Final = 2.0
RETAKE_INTERVAL_S: Final = 2.0
_SUPPORTED: Final = sys.platform == "linux"


class ClaimIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What the claim's holder says of itself (Rule 2)."""

    pid: int
    instance: str
    config_sha256: str
    config_path: str = ""


class PortShared(Exception):
    """Another Edge, with another config, serves this caller port (Rule 3)."""


_decode_identity = msgspec.json.Decoder(ClaimIdentity).decode
_encode = msgspec.json.Encoder().encode


def claim_name(sockaddr: tuple[str, int] | tuple[str, int, int, int]) -> bytes:
    """The abstract socket name for a bound caller address (Rule 1)."""
    host, port = sockaddr[0], sockaddr[1]
    return f"\0iop-edge caller {host}:{port}".encode()


@dataclass(eq=False)
class CallerPortClaim:
    """This Edge's side of the claim on its caller port."""

    name: bytes
    identity: ClaimIdentity
    holder: socket.socket | None = None
    """The listening name socket while this Edge holds the claim."""

    @classmethod
    def claim(
        cls, caller: socket.socket, identity: ClaimIdentity, *, inherited: bool = False
    ) -> CallerPortClaim:
        """Claim the caller port bound as `caller`; raises `PortShared` (Rule 3). An
        `inherited` socket (a restart successor's) is not checked (Rule 4)."""
        claim = cls(name=claim_name(caller.getsockname()), identity=identity)
        if not _SUPPORTED:
            return claim  # Rule 5
        if claim._try_hold() or inherited:
            return claim
        other = claim._ask_holder()
        if other.config_sha256 != identity.config_sha256:
            raise PortShared(
                f"{_address(claim.name)} is already served by another Edge with a different "
                f"config (pid {other.pid}, {other.instance}, config "
                f"{other.config_path or '?'} sha256 {other.config_sha256[:12]}…; this one's "
                f"is {identity.config_sha256[:12]}…): callers would be split between two "
                "pools. Only replicas of the same config may share the caller port: stop "
                "the other Edge, give this one another `openai.listen`, or restart the "
                "other one with `iop-edge restart` to change its config"
            )
        return claim

    async def serve(self) -> None:
        """Answer who holds the claim (Rule 2), and take it over when its holder exits
        (Rule 4). Runs until cancelled; closes the name socket on the way out."""
        if not _SUPPORTED:
            return
        line = _encode(self.identity) + b"\n"
        try:
            while self.holder is None:
                await trio.sleep(RETAKE_INTERVAL_S)  # periodic retry, not synchronisation
                self._try_hold()
            listener = trio.socket.from_stdlib_socket(self.holder)
            while True:
                conn, _ = await listener.accept()
                with conn:
                    try:
                        await conn.send(line)
                    except OSError:
                        pass  # the asker went away; nothing of ours depends on it
        finally:
            self.close()

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None

    def _try_hold(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        sock.listen(16)
        sock.setblocking(False)
        self.holder = sock
        return True

    def _ask_holder(self) -> ClaimIdentity:
        """Read the holder's identity line; blocking, bounded by `ASK_TIMEOUT_S` (start-up
        runs before the Edge's event loop serves anything)."""
        what = _address(self.name)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(ASK_TIMEOUT_S)
                sock.connect(self.name)
                data = b""
                while not data.endswith(b"\n") and len(data) < 4096:
                    piece = sock.recv(4096)
                    if not piece:
                        break
                    data += piece
        except OSError as exc:
            raise PortShared(
                f"{what} is claimed by another process that did not say which config it "
                f"runs ({exc.strerror or exc}); refusing to share the caller port with it"
            ) from None
        try:
            return _decode_identity(data.strip())
        except msgspec.DecodeError:
            raise PortShared(
                f"{what} is claimed by a process that is not an IOP Edge of this version; "
                "refusing to share the caller port with it"
            ) from None


def _address(name: bytes) -> str:
    return "the caller port " + name.decode().removeprefix("\0iop-edge caller ")


def own_identity(instance: str, config_sha256: str, config_path: str) -> ClaimIdentity:
    """This process's identity for its claim."""
    return ClaimIdentity(
        pid=os.getpid(), instance=instance, config_sha256=config_sha256, config_path=config_path
    )
