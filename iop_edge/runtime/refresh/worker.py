"""The refresh worker: a child process that reads, checks and plans refresh candidates.

Reading and planning a fleet's config is seconds of pure Python and a million objects.
In the Edge's process that work would share the GIL, the allocator and the cyclic
collector with the event loop that serves callers; here it has a process of its own, and
the Edge's loop only waits for the answer (`refresh.worker_client`). The Edge starts it
as `python -m iop_edge.procedures.refresh_worker` (this worker with the ledger's check,
Rule 7); it speaks `refresh.worker_protocol` on its stdin and stdout and ends when its
stdin closes.

Rules:
1. It keeps what makes the next refresh cheap: the base config by revision (the running
   one and, after a build, the one that would run next) and the proof of the last valid
   candidate (`core.configuration.config_proof`), so a candidate is checked only where it changed.
2. A candidate is diffed and planned exactly as in the Edge (`core.refresh.refresh_plan`); a
   built one goes back as a per-Node delta (`worker_protocol`, Rule 3).
3. Nothing it is sent ends it but the end of its input: an unexpected error answers
   `Failed` naming it, and the worker reads the next request.
4. A request that takes longer than its `deadline_s` (a hang: a bug looping, a candidate
   that defeats the reader's bounds) ends the worker, with every thread's stack on its
   stderr (`faulthandler`, a watchdog in real time that needs no GIL). The Edge sees its
   end, fails that refresh and starts another worker; its own deadline backs this up.
5. The cyclic collector never runs: a fleet's candidate is a million objects, none of
   them garbage until the answer is sent, and collections would walk them again and
   again. Reading and planning makes next to no cyclic garbage (a dozen objects a
   candidate: what it no longer holds, reference counting frees), so after each answer
   what is alive is frozen (`gc.freeze`, no walk) instead of collected: a collection
   would walk the worker's million objects for nothing while the Edge pushes the apply
   to its Nodes, on the same cores.
6. It runs at a lower scheduling priority than the Edge (`NICENESS`): on a machine whose
   cores are all busy, the operating system gives them to the Edge's event loop first,
   as callers need, and the refresh takes longer instead.
7. A candidate that moves the usage ledger (`edge.ledger`, its password variable, or
   `edge.state_dir`) is checked as `serve` and `check-config` check it (`LedgerCheck`:
   room in `state_dir`, the PostgreSQL server reachable), so an applied candidate
   written to the config file never makes the next start fail. The check is given by
   whoever starts the worker: the ledger lives in a room of the runtime the refresh may
   not import. A candidate that leaves the ledger as it runs is not checked again: a
   full disk must not stop the refresh that copes with it.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import traceback
from collections.abc import Callable
from typing import BinaryIO, Final

import msgspec

from iop_edge.core.configuration.config import ConfigInvalid, ParsedConfig
from iop_edge.core.configuration.config_proof import ConfigProof
from iop_edge.core.lifecycle import idle_rules
from iop_edge.core.refresh.refresh_plan import needs_push, plan_apply
from iop_edge.runtime.refresh.config_file import check_config, load_config
from iop_edge.runtime.refresh.worker_protocol import (
    HEADER_BYTES,
    PIECE_ITEMS,
    VERSION,
    Built,
    Failed,
    Hello,
    Invalid,
    Plan,
    Prepare,
    Prepared,
    Reply,
    frame,
)
from schemas.config import ConfigError, EdgeConfig, EdgeSection, IdleRule, NodeEntry

__all__ = ["LedgerCheck", "Worker", "delta", "main"]

#: What `serve` would refuse of the ledger an `edge` section configures (Rule 7).
LedgerCheck = Callable[[EdgeSection], list[ConfigError]]

#: Added to the worker's niceness (Rule 6).
NICENESS: Final = 10

_DECODE_PREPARE: Final = msgspec.msgpack.Decoder(Prepare)
_DECODE_CONFIG: Final = msgspec.msgpack.Decoder(EdgeConfig)
_DECODE_NODE: Final = msgspec.msgpack.Decoder(NodeEntry)
_ENCODER: Final = msgspec.msgpack.Encoder()


class Worker:
    """The worker's state and its one operation (module docstring)."""

    def __init__(self, ledger_check: LedgerCheck | None = None) -> None:
        self.bases: dict[int, EdgeConfig] = {}
        self.proof: ConfigProof | None = None
        self._ledger_check = ledger_check

    def prepare(self, request: Prepare, pieces: list[bytes]) -> Reply:
        """`pieces`: the frames that followed `request` (`worker_protocol`, Rules 2, 4)."""
        base = self.bases.get(request.base_revision)
        if request.base_config is not None:
            nodes = [_DECODE_NODE.decode(piece) for piece in pieces[: request.base_nodes]]
            rest = _DECODE_CONFIG.decode(request.base_config)
            base = msgspec.structs.replace(rest, nodes=nodes)
        if base is None:
            return Failed(f"the worker does not hold revision {request.base_revision}")
        self.bases = {request.base_revision: base}
        try:
            parsed = self._load(request, pieces[request.base_nodes :])
        except ConfigInvalid as invalid:
            return Invalid(invalid.errors)
        self.proof = parsed.proof
        candidate = parsed.config.edge
        if self._ledger_check is not None and _ledger_of(candidate) != _ledger_of(base.edge):
            problems = self._ledger_check(candidate)  # Rule 7
            if problems:
                return Invalid(problems)
        plan = plan_apply(
            base,
            parsed.config,
            pending_restart=tuple(request.pending_restart),
            allow_restart_required=request.allow_restart_required,
        )
        diff = plan.diff
        summary = Plan(
            changes=list(diff.changes),
            changed_nodes=list(diff.changed_nodes),
            changed_providers=list(diff.changed_providers),
            changed_models=list(diff.changed_models),
            pending_restart=list(plan.pending_restart),
            errors=list(plan.errors),
        )
        built = None
        if request.build and not plan.errors:
            built = delta(base, plan.effective)
            self.bases[request.base_revision + 1] = plan.effective
        return Prepared(
            config_sha256=parsed.sha256,
            plan=summary,
            built=built,
            parsed_nodes=parsed.parsed_nodes,
            checked_nodes=parsed.checked_nodes,
        )

    def _load(self, request: Prepare, text: list[bytes]) -> ParsedConfig:
        if request.text_pieces is not None:
            return check_config(b"".join(text).decode("utf-8"), proof=self.proof)
        if request.config_path is not None:
            return load_config(request.config_path, proof=self.proof)
        raise ConfigInvalid([])  # the Edge sends one or the other


def _ledger_of(edge: EdgeSection) -> tuple[str | None, str | None, str]:
    """The settings that place the usage ledger (Rule 7)."""
    return edge.ledger, edge.ledger_password_env, edge.state_dir


def delta(base: EdgeConfig, effective: EdgeConfig) -> Built:
    """`effective` over `base`, a Node at a time (`worker_protocol`, Rule 3)."""
    before: dict[str, NodeEntry] = {node.id: node for node in base.nodes}
    idle_before, idle_after = _idle_rules(base), _idle_rules(effective)
    ids: list[str] = []
    changed: list[int] = []
    nodes: list[bytes] = []
    to_push: list[str] = []
    for index, node in enumerate(effective.nodes):
        ids.append(node.id)
        old = before.get(node.id)
        idle = (idle_before.get(node.id, ()), idle_after.get(node.id, ()))
        if old is not None and (old is node or old == node):
            if idle[0] != idle[1]:  # its models' idle rules changed, its entry did not
                to_push.append(node.id)
            continue
        changed.append(index)
        nodes.append(_ENCODER.encode(node))
        if needs_push(old, node, *idle):
            to_push.append(node.id)
    rest = msgspec.structs.replace(effective, nodes=[])
    return Built(
        rest=_ENCODER.encode(rest),
        ids=ids,
        changed=changed,
        nodes=nodes,
        to_push=sorted(to_push),
    )


def _idle_rules(config: EdgeConfig) -> dict[str, tuple[IdleRule, ...]]:
    """Each Node's idle rules, as the snapshot of `config` holds them (`Snapshot.idle`)."""
    provider_node = {provider.id: node.id for node in config.nodes for provider in node.providers}
    return idle_rules(config.models, provider_node)


def _write_reply(replies: BinaryIO, reply: Reply) -> None:
    """`reply`, then its plan's long lists in pieces and a built candidate's changed
    Nodes, a frame each (`worker_protocol`, Rules 3 and 5)."""
    pieces: list[bytes] = []
    if isinstance(reply, Prepared):
        plan, lists = reply.plan.cut()
        pieces = [
            _ENCODER.encode(items[start : start + PIECE_ITEMS])
            for items in lists
            for start in range(0, len(items), PIECE_ITEMS)
        ]
        reply = msgspec.structs.replace(reply, plan=plan)
    if isinstance(reply, Prepared) and reply.built is not None:
        pieces += reply.built.nodes
        reply = msgspec.structs.replace(reply, built=msgspec.structs.replace(reply.built, nodes=[]))
    replies.write(frame(_ENCODER.encode(reply)))
    for piece in pieces:
        replies.write(frame(piece))
    replies.flush()


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    data = stream.read(size)
    if len(data) < size:
        return None
    return data


def _read_frame(stream: BinaryIO) -> bytes | None:
    header = _read_exactly(stream, HEADER_BYTES)
    if header is None:
        return None
    return _read_exactly(stream, int.from_bytes(header, "big"))


def serve(
    requests: BinaryIO, replies: BinaryIO, *, ledger_check: LedgerCheck | None = None
) -> None:
    """Answer requests until `requests` ends (Rule 3)."""
    worker = Worker(ledger_check)
    gc.disable()  # Rule 5
    replies.write(frame(_ENCODER.encode(Hello(VERSION))))
    replies.flush()
    while True:
        payload = _read_frame(requests)
        if payload is None:
            return
        reply: Reply
        try:
            request = _DECODE_PREPARE.decode(payload)
            pieces: list[bytes] = []
            for _ in range(request.base_nodes + (request.text_pieces or 0)):
                piece = _read_frame(requests)
                if piece is None:
                    return
                pieces.append(piece)
            if request.deadline_s is not None:
                faulthandler.dump_traceback_later(request.deadline_s, exit=True)  # Rule 4
            try:
                reply = worker.prepare(request, pieces)
            finally:
                faulthandler.cancel_dump_traceback_later()
        except Exception as exc:  # Rule 3: named to the Edge, and the worker goes on
            traceback.print_exc(file=sys.stderr)
            reply = Failed(f"{type(exc).__name__}: {exc}")
        _write_reply(replies, reply)
        del reply
        gc.freeze()  # Rule 5


def main(ledger_check: LedgerCheck | None = None) -> None:
    """Serve on stdin and the stdout this process was given; anything else that writes to
    stdout (a stray print) goes to stderr instead, never into the frames."""
    try:
        os.nice(NICENESS)  # Rule 6
    except OSError:  # not allowed here: the refresh runs at the Edge's priority
        pass
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, replies, ledger_check=ledger_check)


if __name__ == "__main__":
    main()
