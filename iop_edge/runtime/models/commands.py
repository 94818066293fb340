"""The operator's model loads and unloads (design §18, `POST /models/load|unload`).

An operator names a catalog model (and, optionally, a provider); the Edge picks the
provider a load goes to (`core.routing.placement`), sends its Node a `model_command` per
provider and answers once every runtime did it, or said why not. The Node serialises
the commands and joins equal ones (`iop_node.runs.model_control`), so two Edges asking for
the same load cause one.

Every command that reaches a Node is audited, one line per provider acted on, in
`state_dir/model-audit.jsonl` (fsynced, like the refresh audit log): who asked, what,
where, and how it ended.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol

import msgspec
import trio

from iop_edge.core.routing.placement import choose_load, holders_of, pinned_at
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.nodes.session import SessionClosed
from iop_edge.runtime.refresh.audit import append_line
from schemas import wire
from schemas.catalog import (
    CatalogProvider,
    ModelCommandAction,
    ModelCommandReport,
    ModelCommandRequest,
    ModelCommandResult,
)

__all__ = ["AUDIT_FILE_NAME", "ModelCommands"]

log = logging.getLogger(__name__)

AUDIT_FILE_NAME: Final = "model-audit.jsonl"
#: Beyond the provider's `adapter.load_timeout_s` (which bounds the runtime on the
#: Node), the time a command's answer may take to come back.
ANSWER_GRACE_S: Final = 10.0


class CommandSession(Protocol):
    """What a command needs of a Node's session."""

    features: frozenset[str]

    async def request_model_command(self, command: wire.ModelCommand) -> wire.ModelCommandDone: ...


class _AuditLine(msgspec.Struct, frozen=True, kw_only=True):
    time: str
    source: str
    action: ModelCommandAction
    model: str
    provider: str
    served_model: str
    ok: bool
    error: str | None = None


class ModelCommands:
    """Runs the operator's loads and unloads against the pool."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], Snapshot],
        providers: Callable[[Sequence[str]], list[CatalogProvider]],
        session_of: Callable[[str], CommandSession | None],
        state_dir: Path,
    ) -> None:
        """`providers`: the catalog records of these provider ids (what their Nodes last
        reported); `session_of`: a connected Node's session."""
        self._snapshot = snapshot
        self._providers = providers
        self._session_of = session_of
        self._audit_path = state_dir / AUDIT_FILE_NAME
        self._encode = msgspec.json.Encoder().encode

    async def run(
        self, action: ModelCommandAction, request: ModelCommandRequest, *, source: str
    ) -> ModelCommandReport:
        """Do `action` for `request`; the report says what each provider's runtime did."""
        snapshot = self._snapshot()
        model = snapshot.models.get(request.model)
        if model is None:
            return ModelCommandReport(
                action=action,
                model=request.model,
                outcome="unknown",
                error=f"no model {request.model!r}",
            )
        served = dict(model.providers)
        if request.provider is not None:
            if request.provider not in served:
                return ModelCommandReport(
                    action=action,
                    model=request.model,
                    outcome="unknown",
                    error=f"provider {request.provider!r} does not serve {request.model!r}",
                )
            served = {request.provider: served[request.provider]}
        records = [(p, served[p.id]) for p in self._providers(list(served))]
        targets: list[tuple[str, str]]
        if action == "unload":
            targets = holders_of(records) if request.provider is None else list(served.items())
            pinned = pinned_at(records)
            kept = [
                ModelCommandResult(
                    provider=provider,
                    served_model=name,
                    ok=False,
                    error=f"pinned here: `iop-edge models unpin {request.model}` first (or "
                    "its models[].lifecycle.keep_loaded)",
                )
                for provider, name in targets
                if provider in pinned
            ]
            targets = [(provider, name) for provider, name in targets if provider not in pinned]
            if not targets and not kept:
                return ModelCommandReport(
                    action=action,
                    model=request.model,
                    outcome="done",
                    error="loaded nowhere: nothing to unload",
                )
            if kept:
                report = await self.send(snapshot, action, request.model, targets, source=source)
                results = sorted([*report.results, *kept], key=lambda result: result.provider)
                outcome = "failed" if report.outcome == "failed" else "refused"
                return msgspec.structs.replace(report, outcome=outcome, results=results)
        else:
            choice = choose_load(records)
            if choice.provider is None:
                return ModelCommandReport(
                    action=action,
                    model=request.model,
                    outcome="no_provider",
                    error=f"no provider can load {request.model!r}: {choice.reason}",
                )
            targets = [(choice.provider, served[choice.provider])]
            if choice.already:  # nothing to do: it holds the model
                result = ModelCommandResult(
                    provider=choice.provider, served_model=served[choice.provider], ok=True
                )
                return ModelCommandReport(
                    action=action, model=request.model, outcome="done", results=[result]
                )
        return await self.send(snapshot, action, request.model, targets, source=source)

    async def send(
        self,
        snapshot: Snapshot,
        action: ModelCommandAction,
        model: str,
        targets: Sequence[tuple[str, str]],
        *,
        source: str,
    ) -> ModelCommandReport:
        """Send `action` on `model` to each (provider, served name) of `targets` at once,
        audit what each did, and report it."""
        results: list[ModelCommandResult] = []
        async with trio.open_nursery() as nursery:
            for provider_id, served_name in targets:
                nursery.start_soon(
                    self._one, snapshot, action, provider_id, served_name, results.append
                )
        results.sort(key=lambda result: result.provider)
        await self._audit(source, action, model, results)
        ok = all(result.ok for result in results)
        return ModelCommandReport(
            action=action, model=model, outcome="done" if ok else "failed", results=results
        )

    async def _one(
        self,
        snapshot: Snapshot,
        action: ModelCommandAction,
        provider_id: str,
        served: str,
        report: Callable[[ModelCommandResult], None],
    ) -> None:
        node_id = snapshot.provider_node[provider_id]
        session = self._session_of(node_id)
        error: str | None = None
        if session is None:
            error = f"node {node_id} is not connected"
        elif (sent := _as_understood(action, session.features)) is not None:
            command = wire.ModelCommand(
                command_id=uuid.uuid4().hex, provider_id=provider_id, action=sent, model=served
            )
            bound = snapshot.providers[provider_id].adapter.load_timeout_s + ANSWER_GRACE_S
            error = await _answer(session, command, node_id, bound)
        report(
            ModelCommandResult(
                provider=provider_id, served_model=served, ok=error is None, error=error
            )
        )

    async def _audit(
        self,
        source: str,
        action: ModelCommandAction,
        model: str,
        results: list[ModelCommandResult],
    ) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        lines = b"".join(
            self._encode(
                _AuditLine(
                    time=stamp,
                    source=source,
                    action=action,
                    model=model,
                    provider=result.provider,
                    served_model=result.served_model,
                    ok=result.ok,
                    error=result.error,
                )
            )
            + b"\n"
            for result in results
        )
        if not lines:
            return
        with trio.move_on_after(ANSWER_GRACE_S, shield=True):
            try:
                await trio.to_thread.run_sync(
                    append_line, self._audit_path, lines, abandon_on_cancel=True
                )
            except OSError as exc:
                log.error("model audit log %s not written: %s", self._audit_path, exc)


def _as_understood(
    action: ModelCommandAction, features: frozenset[str]
) -> ModelCommandAction | None:
    """What to send a Node for `action`: to one that does not name `FEATURE_PINS`, a pin
    is a load (the pin holds on this Edge alone) and an unpin is nothing."""
    if action in ("pin", "unpin") and wire.FEATURE_PINS not in features:
        return "load" if action == "pin" else None
    return action


async def _answer(
    session: CommandSession, command: wire.ModelCommand, node_id: str, bound: float
) -> str | None:
    """Send one command to a Node and wait (at most `bound`) for its answer: None when
    done, else why not."""
    error: str | None = f"node {node_id} did not answer within {bound:g}s"
    with trio.move_on_after(bound):
        try:
            done = await session.request_model_command(command)
        except SessionClosed as exc:  # the Node is gone
            error = f"node {node_id} went away: {exc}"
        else:
            error = None if done.ok else (done.error or "the runtime refused")
    return error
