"""Live config refresh end to end (design §5): a real Edge, real Nodes, the `openai` SDK.

The headline test applies one live change after another while eight callers stream in a
loop, and checks every single request against the configs it could have run under: a
request that started after apply N finished and ended before apply N+1 began saw exactly
config N; one that overlapped an apply may have seen either side, never anything else.

The other tests pin one rule each: queue policy changes reach waiting requests, dry
runs, restart-required changes, invalid candidates, `if_revision`, no-change applies,
per-node pushes and registry drains, one refresh at a time, the config file and the
audit log, and the SIGHUP path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import trio
import trio.testing
import yaml
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from trio_websocket import WebSocketConnection, open_websocket_url

from iop_edge.core.snapshot import QueuePolicy
from iop_edge.main import _apply_from_file, handle_signals
from iop_edge.runtime.refresh.audit import AUDIT_FILE_NAME
from iop_edge.runtime.refresh.push import RETRY_NOTE
from iop_node.adapters.base import Adapter, Emit, RunResult
from iop_node.registry import create_adapter
from iop_node.reply import ParsedChunk
from schemas import wire
from schemas.config import ProviderConfig
from schemas.wire import ProviderStatus, Run
from tests.e2e.stack import (
    NODE_TOKEN,
    NODE_TOKEN_HASH,
    WAIT_GUARD_S,
    Stack,
    edge_config,
    sim_provider,
    start_stack,
)
from tests.hostile.peers import hand_driven_node

Doc = dict[str, Any]
Edit = Callable[[Doc], None]

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
FAST = {"ttft_ms": 2, "tokens_per_second": 1000}
#: Tokens of a run held across a refresh (see `TrackedAdapter.hold`).
LONG_RUN_TOKENS = 30

REPORT_LISTS = (
    "changed_nodes",
    "changed_providers",
    "changed_models",
    "changes",
    "live_paths",
    "restart_required_paths",
    "pending_restart",
    "errors",
    "nodes",
    "replicas",
)


# --- config documents --------------------------------------------------------------------


def _edit(text: str, *edits: Edit) -> str:
    doc: Doc = yaml.safe_load(text)
    for edit in edits:
        edit(doc)
    dumped: str = yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False)
    return dumped


def _provider_of(doc: Doc, provider_id: str) -> Doc:
    found: Doc = next(
        p for node in doc["nodes"] for p in node["providers"] if p["id"] == provider_id
    )
    return found


def _model_of(doc: Doc, model_id: str) -> Doc:
    found: Doc = next(m for m in doc["models"] if m["id"] == model_id)
    return found


def set_provider(provider_id: str, **fields: Any) -> Edit:
    def edit(doc: Doc) -> None:
        _provider_of(doc, provider_id).update(fields)

    return edit


def set_adapter(provider_id: str, **fields: Any) -> Edit:
    def edit(doc: Doc) -> None:
        _provider_of(doc, provider_id)["adapter"].update(fields)

    return edit


def add_model(model: Doc) -> Edit:
    def edit(doc: Doc) -> None:
        doc["models"].append(model)

    return edit


def remove_model(model_id: str) -> Edit:
    def edit(doc: Doc) -> None:
        doc["models"] = [m for m in doc["models"] if m["id"] != model_id]

    return edit


def set_model(model_id: str, **fields: Any) -> Edit:
    def edit(doc: Doc) -> None:
        _model_of(doc, model_id).update(fields)

    return edit


def set_section(section: str, **fields: Any) -> Edit:
    def edit(doc: Doc) -> None:
        doc.setdefault(section, {}).update(fields)

    return edit


# --- admin API and catalog helpers --------------------------------------------------------


async def post_refresh(stack: Stack, **body: Any) -> tuple[int, Doc]:
    async with stack.admin() as admin:
        response = await admin.post("/refresh", json=body)
    report: Doc = response.json()
    return response.status_code, report


async def get_json(stack: Stack, path: str) -> Doc:
    async with stack.admin() as admin:
        response = await admin.get(path)
    assert response.status_code == 200, response.text
    document: Doc = response.json()
    return document


def provider_in(catalog: Doc, provider_id: str) -> Doc:
    found: Doc = next(p for p in catalog["providers"] if p["id"] == provider_id)
    return found


def all_idle(catalog: Doc) -> bool:
    return all(p["in_flight"] == 0 and p["long_in_flight"] == 0 for p in catalog["providers"]) and (
        all(m["queued"] == 0 for m in catalog["models"])
    )


def assert_report_shape(report: Doc) -> None:
    """design §5 step 3: every field present, every list a list (never null) and sorted."""
    assert set(report) == {"mode", "outcome", "base_revision", "revision", *REPORT_LISTS}
    for key in REPORT_LISTS:
        assert isinstance(report[key], list), key
    for key in (
        "changed_nodes",
        "changed_providers",
        "changed_models",
        "live_paths",
        "restart_required_paths",
        "pending_restart",
    ):
        assert report[key] == sorted(report[key]), key
    assert [c["path"] for c in report["changes"]] == sorted(c["path"] for c in report["changes"])
    assert [e["path"] for e in report["errors"]] == sorted(e["path"] for e in report["errors"])
    assert [n["id"] for n in report["nodes"]] == sorted(n["id"] for n in report["nodes"])


def node_results(report: Doc) -> list[tuple[str, str, int | None]]:
    return [(n["id"], n["status"], n["revision"]) for n in report["nodes"]]


# --- what the Nodes build ------------------------------------------------------------------


class TrackedAdapter:
    """A real adapter, watched: how many runs it executes and when it is closed.

    With `hold`, each streamed run pauses after its first token until `hold` is set, so
    a test can keep a run in flight across a refresh without racing the clock.
    """

    def __init__(self, inner: Adapter, hold: trio.Event | None = None) -> None:
        self.inner = inner
        self.provider: ProviderConfig = inner.provider
        self.hold = hold
        self.runs = 0
        self.active = 0
        self.active_when_closed: int | None = None
        self.closed = trio.Event()

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        self.runs += 1
        self.active += 1
        try:
            return await self.inner.execute(run, self._held(emit))
        finally:
            self.active -= 1

    def _held(self, emit: Emit) -> Emit:
        hold = self.hold
        if hold is None:
            return emit
        sent = 0

        async def emit_then_hold(data: bytes, parsed: ParsedChunk | None = None, /) -> None:
            nonlocal sent
            await emit(data, parsed)
            sent += 1
            if sent == 2:  # the role chunk, then the first token
                await hold.wait()

        return emit_then_hold

    async def probe(self) -> ProviderStatus:
        return await self.inner.probe()

    async def aclose(self) -> None:
        self.active_when_closed = self.active
        self.closed.set()
        await self.inner.aclose()


class AdapterLog:
    """The adapter factory of one Node: the real one, recording every adapter it builds.

    Adapters built while `hold` is set hold their runs (see `TrackedAdapter`)."""

    def __init__(self, hold: trio.Event | None = None) -> None:
        self.adapters: list[TrackedAdapter] = []
        self.hold = hold

    def factory(self, provider: ProviderConfig) -> Adapter:
        adapter = TrackedAdapter(create_adapter(provider), self.hold)
        self.adapters.append(adapter)
        return adapter

    @property
    def built(self) -> list[str]:
        return [adapter.provider.id for adapter in self.adapters]

    def latest(self, provider_id: str) -> TrackedAdapter:
        return [a for a in self.adapters if a.provider.id == provider_id][-1]


# --- streaming helpers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamResult:
    provider: str | None
    result: str
    """`ok`, `not_found`, or a description of what else happened."""


async def stream_chat(client: openai.AsyncOpenAI, model: str, tokens: int) -> StreamResult:
    """One streaming chat; `ok` only when every token and the finish reason arrived."""
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=MESSAGES, max_tokens=tokens, stream=True
        )
    except openai.NotFoundError as exc:
        return StreamResult(None, "not_found" if exc.code == "model_not_found" else repr(exc))
    except openai.APIError as exc:
        return StreamResult(None, f"refused before the stream: {exc!r}")
    provider = raw.headers.get("x-iop-provider")
    pieces: list[str] = []
    finish: str | None = None
    aliases: set[str] = set()
    try:
        async for chunk in raw.parse():
            aliases.add(chunk.model)
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    except openai.APIError as exc:
        return StreamResult(provider, f"failed after {len(pieces)} token(s): {exc.message}")
    if (len(pieces), finish, aliases) != (tokens, "length", {model}):
        return StreamResult(provider, f"incomplete: {len(pieces)} token(s), finish {finish}")
    return StreamResult(provider, "ok")


# --- 1. live changes under streaming load --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stage:
    """One config in the sequence: the YAML, and what a request under it may get."""

    text: str
    models: frozenset[str]
    dispatching: frozenset[str]
    """Providers that may take new runs (enabled)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    model: str
    stages: range
    """Indexes of the configs the request may have run under."""
    provider: str | None
    result: str


class StreamingLoad:
    """Callers that stream in a loop until stopped (or out of budget), while the test
    applies refreshes; each request is recorded with the configs it could have seen."""

    def __init__(self, stack: Stack, *, callers: int, budget: int, tokens: int) -> None:
        self.stack = stack
        self.callers = callers
        self.tokens = tokens
        self.outcomes: list[Outcome] = []
        self.applies_started = 0
        self.applies_done = 0
        self._budget = budget
        self._stop = trio.Event()
        self._progress = trio.Event()

    def model_for(self, caller: int, turn: int) -> str:
        """Callers 0-5 ask for `m`; the last two alternate `m` and `m2`, which comes and
        goes with the refreshes."""
        return "m2" if caller >= self.callers - 2 and turn % 2 else "m"

    async def run(self, client: openai.AsyncOpenAI) -> None:
        async with trio.open_nursery() as nursery:
            for caller in range(self.callers):
                nursery.start_soon(self._caller, client, caller)

    def stop(self) -> None:
        self._stop.set()

    async def _caller(self, client: openai.AsyncOpenAI, caller: int) -> None:
        turn = 0
        while not self._stop.is_set() and self._budget > 0:
            self._budget -= 1
            model = self.model_for(caller, turn)
            turn += 1
            first = self.applies_done
            outcome = await stream_chat(client, model, self.tokens)
            last = self.applies_started
            self.outcomes.append(
                Outcome(model, range(first, last + 1), outcome.provider, outcome.result)
            )
            self._progress.set()
            self._progress = trio.Event()

    async def wait_completions(self, count: int) -> None:
        target = len(self.outcomes) + count
        with trio.fail_after(WAIT_GUARD_S):
            while len(self.outcomes) < target:
                assert self._budget > 0, "the load ran out of requests"
                await self._progress.wait()

    async def apply(self, text: str) -> Doc:
        """Apply `text` while streams are in flight; returns the report."""
        await self.wait_completions(self.callers)
        await self.stack.wait_catalog(lambda c: any(p["in_flight"] for p in c["providers"]))
        self.applies_started += 1
        status, report = await post_refresh(self.stack, mode="apply", config_yaml=text)
        self.applies_done += 1
        assert status == 200, report
        assert report["outcome"] == "applied", report
        assert report["revision"] == self.applies_done + 1
        return report


def allowed(outcome: Outcome, stages: list[Stage]) -> bool:
    seen = [stages[index] for index in outcome.stages]
    results = {"ok" if outcome.model in stage.models else "not_found" for stage in seen}
    if outcome.result not in results:
        return False
    if outcome.result == "ok":
        return any(outcome.provider in stage.dispatching for stage in seen)
    return True


async def test_live_changes_under_streaming_load_lose_no_request(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # sim-c serves no model until m2 arrives: m2 shares sim-a with the busy `m` but has
    # a provider of its own too, so its requests are not starved by m's queue.
    base = edge_config(
        tmp_path,
        providers=[
            sim_provider("sim-a", capacity=2, adapter=FAST),
            sim_provider("sim-b", capacity=2, adapter=FAST),
            sim_provider("sim-c", capacity=2, adapter=FAST),
        ],
        models=[{"id": "m", "providers": {"sim-a": "sim-small", "sim-b": "sim-small"}}],
    )
    served = ["sim-small", "sim-large"]
    everyone = frozenset({"sim-a", "sim-b", "sim-c"})
    not_b = frozenset({"sim-a", "sim-c"})
    m2 = {
        "id": "m2",
        "display_name": "Model two",
        "providers": {"sim-a": "sim-large", "sim-c": "sim-large"},
    }
    capacity = _edit(base, set_provider("sim-a", capacity=3))
    priority = _edit(capacity, set_provider("sim-b", priority=1))
    disabled = _edit(priority, set_provider("sim-b", enabled=False))
    added = _edit(
        disabled,
        set_provider("sim-a", models=served),
        set_provider("sim-c", models=served),
        add_model(m2),
    )
    removed = _edit(added, remove_model("m2"))
    queue = _edit(removed, set_model("m", queue={"max_queue": 64, "queue_timeout_ms": 20000}))
    stages = [
        Stage(base, frozenset({"m"}), everyone),
        Stage(capacity, frozenset({"m"}), everyone),
        Stage(priority, frozenset({"m"}), everyone),
        Stage(disabled, frozenset({"m"}), not_b),
        Stage(added, frozenset({"m", "m2"}), not_b),
        Stage(removed, frozenset({"m"}), not_b),
        Stage(queue, frozenset({"m"}), not_b),
    ]
    stack = await start_stack(nursery, base, tmp_path / "edge.yaml", wait_models=("m",))
    edge = stack.edge
    load = StreamingLoad(stack, callers=8, budget=2000, tokens=12)

    async with stack.client() as client, trio.open_nursery() as callers:
        callers.start_soon(load.run, client)

        report = await load.apply(capacity)
        assert report["live_paths"] == ["nodes[node-1].providers[sim-a].capacity"]
        assert node_results(report) == [("node-1", "applied", 2)]
        catalog = await get_json(stack, "/catalog")
        assert provider_in(catalog, "sim-a")["capacity"] == 3  # at once, no reconnect
        # resized in place (tests/unit/test_scheduler.py: the runs holding slots still count)
        assert edge.scheduler.statistics().providers["sim-a"].capacity == 3

        report = await load.apply(priority)
        assert report["live_paths"] == ["nodes[node-1].providers[sim-b].priority"]
        assert provider_in(await get_json(stack, "/catalog"), "sim-b")["priority"] == 1

        report = await load.apply(disabled)
        assert report["live_paths"] == ["nodes[node-1].providers[sim-b].enabled"]
        sim_b = provider_in(await get_json(stack, "/catalog"), "sim-b")
        assert sim_b["enabled"] is False
        # Its in-flight runs finish (checked with every outcome below); it drains to 0
        # while the callers keep sim-a busy.
        await stack.wait_catalog(lambda c: provider_in(c, "sim-b")["in_flight"] == 0)

        report = await load.apply(added)
        assert report["changed_models"] == ["m2"]
        assert "models[m2]" in report["live_paths"]
        await load.wait_completions(2 * load.callers)

        report = await load.apply(removed)
        assert report["live_paths"] == ["models[m2]"]
        assert report["nodes"] == []  # a catalog-only change: no node to push to
        await load.wait_completions(2 * load.callers)

        report = await load.apply(queue)
        assert report["live_paths"] == ["models[m].queue"]
        assert edge.snapshot.queue_policy("m") == QueuePolicy(max_queue=64, queue_timeout_s=20.0)
        await load.wait_completions(load.callers)
        load.stop()

    await stack.wait_catalog(all_idle)
    bad = [outcome for outcome in load.outcomes if not allowed(outcome, stages)]
    assert not bad, bad
    results = {(o.model, o.result) for o in load.outcomes}
    assert {("m", "ok"), ("m2", "ok"), ("m2", "not_found")} <= results
    for stage in range(1, len(stages)):
        overlapping = [o for o in load.outcomes if {stage - 1, stage} <= set(o.stages)]
        assert overlapping, f"no request was in flight across apply {stage}"
    # sim-b's runs in flight when it was disabled (apply 3) finished in full; nothing
    # that started afterwards went to it.
    drained = [o for o in load.outcomes if o.provider == "sim-b" and {2, 3} <= set(o.stages)]
    assert drained and all(o.result == "ok" for o in drained)
    late = [o for o in load.outcomes if o.stages.start >= 3 and o.result == "ok"]
    assert late and all(o.provider != "sim-b" for o in late)
    assert edge.snapshot.revision == len(stages)


async def test_new_queue_policy_applies_to_waiting_requests(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("only", capacity=1, adapter=FAST)],
        models=[{"id": "m", "providers": {"only": "sim-small"}}],
        dispatch={"max_queue": 8, "queue_timeout_ms": 30000},
    )
    release = trio.Event()
    stack = await start_stack(
        nursery,
        text,
        tmp_path / "edge.yaml",
        wait_models=("m",),
        node_kwargs={"adapter_factory": AdapterLog(hold=release).factory},
    )
    timed_out: list[openai.APIStatusError] = []

    async def wait_in_queue(client: openai.AsyncOpenAI) -> None:
        try:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        except openai.APIStatusError as exc:
            timed_out.append(exc)

    async with stack.client() as client:
        async with trio.open_nursery() as group:
            holder = await client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=LONG_RUN_TOKENS, stream=True
            )
            tokens = await first_tokens(holder)  # held there until `release`
            for _ in range(2):
                group.start_soon(wait_in_queue, client)
            await stack.wait_catalog(lambda c: c["models"][0]["queued"] == 2)
            # 30 s -> 50 ms: the two waiters are past the new deadline and give up now.
            shorter = _edit(text, set_section("dispatch", queue_timeout_ms=50))
            status, report = await post_refresh(stack, mode="apply", config_yaml=shorter)
            assert status == 200, report
            assert report["live_paths"] == ["dispatch.queue_timeout_ms"]
            assert report["nodes"] == []
        assert [(e.status_code, e.code) for e in timed_out] == [(503, "queue_timeout")] * 2

        # max_queue 0: nobody may wait; the next request while the slot is held is 429.
        no_queue = _edit(shorter, set_model("m", queue={"max_queue": 0}))
        status, report = await post_refresh(stack, mode="apply", config_yaml=no_queue)
        assert status == 200, report
        try:
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        except openai.RateLimitError as exc:
            assert exc.code == "queue_full"
        else:
            raise AssertionError("expected queue_full while the only slot is held")

        # The run that held the slot through both refreshes is untouched.
        release.set()
        tokens += [c.choices[0].delta.content or "" async for c in holder if c.choices]
        assert len([t for t in tokens if t]) == LONG_RUN_TOKENS
    await stack.wait_catalog(all_idle)


# --- 2. dry run, restart-required, invalid, if_revision, no change -------------------------


def _one_provider_config(tmp_path: Path, **provider: Any) -> str:
    return edge_config(
        tmp_path,
        providers=[sim_provider("sim-a", capacity=4, adapter=dict(FAST), **provider)],
        models=[{"id": "m", "providers": {"sim-a": "sim-small"}}],
    )


async def _one_provider_stack(
    nursery: trio.Nursery, tmp_path: Path, log: AdapterLog | None = None
) -> Stack:
    text = _one_provider_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    await stack.start_node("node-1", adapter_factory=(log or AdapterLog()).factory)
    await stack.wait_servable("m")
    return stack


async def test_dry_run_changes_nothing(nursery: trio.Nursery, tmp_path: Path) -> None:
    log = AdapterLog()
    stack = await _one_provider_stack(nursery, tmp_path, log)
    original = stack.config_path.read_text(encoding="utf-8")
    catalog_before = await get_json(stack, "/catalog")
    candidate = _edit(original, set_provider("sim-a", capacity=9), add_model({
        "id": "m-new", "providers": {"sim-a": "sim-small"}
    }))  # fmt: skip

    status, report = await post_refresh(stack, mode="dry_run", config_yaml=candidate)

    assert status == 200, report
    assert_report_shape(report)
    assert report["mode"] == report["outcome"] == "dry_run"
    assert report["base_revision"] == report["revision"] == 1
    assert report["live_paths"] == ["models[m-new]", "nodes[node-1].providers[sim-a].capacity"]
    assert report["changed_models"] == ["m-new"]
    assert report["changed_providers"] == ["sim-a"]
    assert report["changed_nodes"] == ["node-1"]
    assert report["nodes"] == [] and report["errors"] == []
    assert stack.edge.snapshot.revision == 1
    assert await get_json(stack, "/catalog") == catalog_before
    assert stack.config_path.read_text(encoding="utf-8") == original
    assert not stack.config_path.with_name("edge.yaml.prev").exists()
    assert log.built == ["sim-a"]  # nothing pushed: the Node built nothing new

    # Without a candidate the dry run reads the config file: unchanged, so no changes.
    status, report = await post_refresh(stack, mode="dry_run")
    assert status == 200
    assert_report_shape(report)
    assert report["changes"] == [] and report["revision"] == 1


async def test_a_candidate_of_megabytes_sent_in_small_pieces_is_read_whole(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _one_provider_stack(nursery, tmp_path, AdapterLog())
    original = stack.config_path.read_text(encoding="utf-8")
    padding = "".join(f"# note {i:07d}\n" for i in range(150_000))  # 2.25 MB of comments
    candidate = _edit(original, set_provider("sim-a", capacity=9)) + padding
    body = json.dumps({"mode": "dry_run", "config_yaml": candidate}).encode()

    async def pieces() -> Any:
        for start in range(0, len(body), 16 * 1024):
            yield body[start : start + 16 * 1024]  # chunked: the Edge reads it as it comes

    async with stack.admin() as admin:
        response = await admin.post(
            "/refresh", content=pieces(), headers={"content-type": "application/json"}
        )

    assert response.status_code == 200, response.text
    report = response.json()
    assert report["outcome"] == "dry_run"
    assert report["live_paths"] == ["nodes[node-1].providers[sim-a].capacity"]


async def test_a_report_of_megabytes_is_answered_whole(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await _one_provider_stack(nursery, tmp_path)
    original = stack.config_path.read_text(encoding="utf-8")
    fields = 4_000  # each unknown, with a long name: a report of more than a megabyte
    long_names = [f"priorty_{i:04d}_{'x' * 250}" for i in range(1, fields)]

    def misspelt(doc: Doc) -> None:
        _provider_of(doc, "sim-a").update(dict.fromkeys(["priorty", *long_names], 1))

    async with stack.admin() as admin:
        response = await admin.post(
            "/refresh", json={"mode": "dry_run", "config_yaml": _edit(original, misspelt)}
        )

    assert response.status_code == 400
    assert int(response.headers["content-length"]) == len(response.content) > 1_000_000
    report = response.json()  # sent in pieces, read whole
    assert report["outcome"] == "rejected"
    assert len(report["errors"]) == fields
    assert report["errors"][-1]["path"] == f"nodes[0].providers[0].{long_names[-1]}"
    # the log names the first twenty and counts the rest
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refresh rej")]
    assert len(told) == 21
    assert told[0] == (
        "refresh rejected: nodes[0].providers[0].priorty: unknown field (did you mean 'priority'?)"
    )
    assert told[-1] == f"refresh rejected: {fields - 20} more error(s) (see the report)"


async def test_restart_required_change_is_refused_unless_allowed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    log = AdapterLog()
    stack = await _one_provider_stack(nursery, tmp_path, log)
    original = stack.config_path.read_text(encoding="utf-8")
    candidate = _edit(
        original,
        set_section("edge", id="edge-renamed"),
        set_section("openai", listen="127.0.0.1:9"),
        set_adapter("sim-a", ttft_ms=7),
        set_provider("sim-a", capacity=6),  # live
    )
    restart_paths = ["edge.id", "nodes[node-1].providers[sim-a].adapter.ttft_ms", "openai.listen"]

    status, report = await post_refresh(stack, mode="apply", config_yaml=candidate)

    assert status == 409, report
    assert_report_shape(report)
    assert report["outcome"] == "rejected"
    assert report["restart_required_paths"] == restart_paths
    assert [e["path"] for e in report["errors"]] == restart_paths
    assert report["live_paths"] == ["nodes[node-1].providers[sim-a].capacity"]
    assert report["revision"] == 1 and report["nodes"] == []
    assert stack.edge.snapshot.revision == 1
    assert provider_in(await get_json(stack, "/catalog"), "sim-a")["capacity"] == 4
    assert stack.config_path.read_text(encoding="utf-8") == original
    assert (await get_json(stack, "/status"))["pending_restart"] == []
    assert log.built == ["sim-a"]

    status, report = await post_refresh(
        stack, mode="apply", config_yaml=candidate, allow_restart_required=True
    )

    assert status == 200, report
    assert_report_shape(report)
    assert report["outcome"] == "applied" and report["revision"] == 2
    assert report["pending_restart"] == restart_paths
    assert report["errors"] == []
    assert node_results(report) == [("node-1", "applied", 2)]
    status_doc = await get_json(stack, "/status")
    assert status_doc["revision"] == 2
    assert status_doc["pending_restart"] == restart_paths
    # The live part runs; the restart-required part keeps its running value.
    assert provider_in(await get_json(stack, "/catalog"), "sim-a")["capacity"] == 6
    assert stack.edge.snapshot.config.edge.id == "edge-test"
    rebuilt = log.latest("sim-a").provider
    assert (rebuilt.capacity, rebuilt.adapter.ttft_ms) == (6, FAST["ttft_ms"])
    # The file holds the whole candidate, so the pending part takes effect at restart.
    assert stack.config_path.read_text(encoding="utf-8") == candidate


async def test_a_candidate_that_moves_the_ledger_where_serve_could_not_open_it_is_invalid(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An applied candidate is written to the config file the next start reads: one that
    moves the ledger is checked as `serve` checks it, or that start would fail."""
    stack = await _one_provider_stack(nursery, tmp_path)
    original = stack.config_path.read_text(encoding="utf-8")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    unreachable = f"postgresql://iop@127.0.0.1:{port}/iop"
    moves = {
        "edge.ledger": set_section("edge", ledger=unreachable),
        "edge.state_dir": set_section("edge", state_dir="/proc/iop-state"),
    }
    said = {}
    for move in moves.values():
        status, report = await post_refresh(
            stack, mode="apply", config_yaml=_edit(original, move), allow_restart_required=True
        )
        assert status == 400, report
        [error] = report["errors"]
        said[error["path"]] = error["message"]
        assert stack.config_path.read_text(encoding="utf-8") == original
    assert said.keys() == moves.keys()
    assert f"cannot reach the ledger at {unreachable}" in said["edge.ledger"]
    assert "stores no files" in said["edge.state_dir"]
    assert stack.edge.snapshot.revision == 1
    # A candidate that leaves the ledger where it is is not checked again.
    candidate = _edit(original, set_section("edge", ledger_buffer_records=500))
    status, report = await post_refresh(
        stack, mode="apply", config_yaml=candidate, allow_restart_required=True
    )
    assert status == 200, report


async def test_invalid_candidate_is_400_with_every_error(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="iop_edge.runtime.refresh.refresh")
    stack = await _one_provider_stack(nursery, tmp_path)
    original = stack.config_path.read_text(encoding="utf-8")

    def mistakes(doc: Doc) -> None:
        provider = _provider_of(doc, "sim-a")
        provider["capacity"] = 0
        provider["priorty"] = 3
        doc["dispatch"] = {"max_queue": -1}
        doc["models"][0]["providers"]["ghost"] = "sim-small"

    status, report = await post_refresh(stack, mode="apply", config_yaml=_edit(original, mistakes))

    assert status == 400, report
    assert_report_shape(report)
    assert report["outcome"] == "rejected" and report["revision"] == 1
    assert [e["path"] for e in report["errors"]] == [
        "dispatch.max_queue",
        "models[0].providers.ghost",
        "nodes[0].providers[0].capacity",
        "nodes[0].providers[0].priorty",
    ]
    assert all(e["message"] for e in report["errors"])
    assert stack.edge.snapshot.revision == 1
    assert stack.config_path.read_text(encoding="utf-8") == original

    status, report = await post_refresh(stack, mode="apply", config_yaml="models: [unclosed")
    assert status == 400
    assert report["errors"] and report["outcome"] == "rejected"
    # An error of the whole file is logged naming the file, not a path.
    stack.config_path.write_text("models: [unclosed", encoding="utf-8")
    status, report = await post_refresh(stack, mode="apply")
    assert status == 400
    told = [r.getMessage() for r in caplog.records]
    assert f"refresh rejected: the config file {stack.config_path}: invalid YAML" in "\n".join(told)
    stack.config_path.write_text(original, encoding="utf-8")

    async with stack.admin() as admin:
        response = await admin.post("/refresh", json={"mode": "apply", "allow_restart": True})
    assert response.status_code == 400  # a typo in the request itself fails loudly


async def test_if_revision_must_match(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _one_provider_stack(nursery, tmp_path)
    candidate = _edit(
        stack.config_path.read_text(encoding="utf-8"), set_provider("sim-a", capacity=5)
    )

    status, report = await post_refresh(stack, mode="apply", config_yaml=candidate, if_revision=7)

    assert status == 409, report
    assert_report_shape(report)
    assert [e["path"] for e in report["errors"]] == ["if_revision"]
    assert stack.edge.snapshot.revision == 1
    assert provider_in(await get_json(stack, "/catalog"), "sim-a")["capacity"] == 4

    status, report = await post_refresh(stack, mode="apply", config_yaml=candidate, if_revision=1)
    assert status == 200, report
    assert report["revision"] == 2


async def test_no_change_apply_makes_a_revision_and_pushes_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    log = AdapterLog()
    stack = await _one_provider_stack(nursery, tmp_path, log)

    status, report = await post_refresh(stack, mode="apply")

    assert status == 200, report
    assert_report_shape(report)
    assert report["outcome"] == "no_change"
    assert (report["base_revision"], report["revision"]) == (1, 2)
    assert report["changes"] == [] and report["nodes"] == []
    assert stack.edge.snapshot.revision == 2
    assert (await get_json(stack, "/catalog"))["revision"] == 2
    assert log.built == ["sim-a"]
    # The node got nothing to ack, so it still reports the revision it was welcomed with.
    nodes = (await get_json(stack, "/status"))["nodes"]
    assert nodes == [{"id": "node-1", "connected": True, "applied_revision": 1}]


# --- 3. pushes: each Node gets its own providers, old registries drain ---------------------


async def test_each_node_gets_its_own_providers_and_old_runs_drain(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = edge_config(
        tmp_path,
        providers=[sim_provider("sim-a", capacity=4, adapter=FAST)],
        models=[
            {"id": "m", "providers": {"sim-a": "sim-small"}},
            {"id": "mc", "providers": {"sim-c": "sim-small"}},
        ],
        extra_nodes=[
            {
                "id": "node-2",
                "token_hash_sha256": NODE_TOKEN_HASH,
                "providers": [sim_provider("sim-c", capacity=2, adapter=FAST)],
            }
        ],
    )
    release = trio.Event()
    logs = {"node-1": AdapterLog(hold=release), "node-2": AdapterLog()}
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    for node_id, log in logs.items():
        await stack.start_node(node_id, adapter_factory=log.factory)
    await stack.wait_servable("m", "mc")
    assert logs["node-1"].built == ["sim-a"]
    assert logs["node-2"].built == ["sim-c"]
    old = logs["node-1"].latest("sim-a")

    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=LONG_RUN_TOKENS, stream=True
        )
        tokens = await first_tokens(stream)  # the run is held on the old adapter
        assert old.active == 1
        logs["node-1"].hold = None  # the adapters built by the refresh run freely

        candidate = _edit(text, set_provider("sim-a", capacity=6, priority=5))
        status, report = await post_refresh(stack, mode="apply", config_yaml=candidate)

        assert status == 200, report
        assert report["changed_nodes"] == ["node-1"]
        assert node_results(report) == [("node-1", "applied", 2)]
        assert logs["node-1"].built == ["sim-a", "sim-a"]
        assert logs["node-2"].built == ["sim-c"]  # node-2 was not pushed anything
        new = logs["node-1"].latest("sim-a")
        assert (new.provider.capacity, new.provider.priority) == (6, 5)
        # The new registry is live, the old one is still draining its run.
        assert not old.closed.is_set() and old.active == 1
        nodes = {n["id"]: n for n in (await get_json(stack, "/status"))["nodes"]}
        assert nodes["node-1"]["applied_revision"] == 2
        assert nodes["node-2"]["applied_revision"] == 1

        # New runs go to the new registry while the old run keeps streaming.
        fresh = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert fresh.choices[0].finish_reason == "length"
        assert (new.runs, old.runs) == (1, 1)
        assert not old.closed.is_set()

        finish = None
        release.set()
        async for chunk in stream:
            if chunk.choices:
                tokens.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        assert len([t for t in tokens if t]) == LONG_RUN_TOKENS
        assert finish == "length"

    with trio.fail_after(WAIT_GUARD_S):
        await old.closed.wait()
    assert old.active_when_closed == 0  # closed only after its run finished
    assert not new.closed.is_set()
    await stack.wait_catalog(all_idle)


async def test_one_refresh_at_a_time_and_a_refused_ack_is_reported(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A hand-driven Node holds its `refresh_ack` back, so the refresh is provably still
    running when the second one arrives; then it refuses the new config."""
    stack = await start_stack(
        nursery, _one_provider_config(tmp_path), tmp_path / "edge.yaml", nodes=()
    )
    candidate = _edit(
        stack.config_path.read_text(encoding="utf-8"), set_provider("sim-a", capacity=2)
    )
    async with open_websocket_url(stack.addresses.node_url) as ws:
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, node_id="node-1", token=NODE_TOKEN)
        await ws.send_message(wire.encode(hello))
        with trio.fail_after(WAIT_GUARD_S):
            assert isinstance(wire.decode_from_edge(await ws.get_message()), wire.Welcome)
        first: dict[str, tuple[int, Doc]] = {}

        async def apply() -> None:
            first["answer"] = await post_refresh(stack, mode="apply", config_yaml=candidate)

        async with trio.open_nursery() as group:
            group.start_soon(apply)
            with trio.fail_after(WAIT_GUARD_S):
                pushed = wire.decode_from_edge(await ws.get_message())
            assert isinstance(pushed, wire.Refresh)
            assert pushed.revision == 2
            assert [(p.id, p.capacity) for p in pushed.node_config.providers] == [("sim-a", 2)]

            status, busy = await post_refresh(stack, mode="apply", config_yaml=candidate)
            assert status == 409, busy
            assert busy["outcome"] == "rejected"
            assert "in progress" in busy["errors"][0]["message"]

            ack = wire.RefreshAck(revision=2, ok=False, error="cannot build sim-a: out of memory")
            await ws.send_message(wire.encode(ack))

    status, report = first["answer"]
    assert status == 200, report
    assert report["outcome"] == "applied"  # the Edge runs it; the node said why it did not
    assert report["nodes"] == [
        {
            "id": "node-1",
            "status": "failed",
            "revision": 2,
            "detail": f"cannot build sim-a: out of memory; {RETRY_NOTE}",
        }
    ]
    assert stack.edge.snapshot.revision == 2


@pytest.mark.parametrize("applies", [True, False], ids=["applied", "refused"])
async def test_a_model_added_to_a_provider_goes_there_once_its_node_applies_it(
    nursery: trio.Nursery, tmp_path: Path, applies: bool
) -> None:
    """A refresh takes effect on the Edge at once and on a Node when the Node applies its
    push (design §5 step 6). A run of a model the refresh gave a provider waits for that
    Node's ack instead of reaching a Node that does not serve the model yet; a Node that
    refuses the config leaves the model without that provider, and the run is refused
    saying so. The hand-driven Node holds its ack back while it "builds"."""
    stack = await start_stack(
        nursery, _one_provider_config(tmp_path), tmp_path / "edge.yaml", nodes=()
    )
    grown = _edit(
        stack.config_path.read_text(encoding="utf-8"),
        set_provider("sim-a", models=["sim-small", "sim-large"]),
        add_model({"id": "m2", "providers": {"sim-a": "sim-large"}}),
    )
    pushed, built = trio.Event(), trio.Event()
    targets: list[str] = []

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Refresh):  # a Node reads nothing else meanwhile
            pushed.set()
            await built.wait()
            error = None if applies else "cannot build sim-a: out of memory"
            ack = wire.RefreshAck(revision=message.revision, ok=applies, error=error)
            await ws.send_message(wire.encode(ack))
        elif isinstance(message, wire.Run):
            targets.append(message.target)
            done = wire.RunDone(run_id=message.run_id, response=_ANSWER)
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    available = wire.ProviderStatus(id="sim-a", health="available", models=["sim-small"])
    first_node = trio.CancelScope()

    async def node(scope: trio.CancelScope, *, task_status: trio.TaskStatus[None]) -> None:
        with scope:
            async with trio.open_nursery() as inner:
                await inner.start(
                    partial(
                        hand_driven_node,
                        stack.addresses.node_url,
                        on_message,
                        status=wire.Status(providers=[available]),
                    )
                )
                task_status.started()

    await nursery.start(node, first_node)
    await stack.wait_servable("m")
    scheduler = stack.edge.scheduler
    answers: dict[str, httpx2.Response] = {}

    async def apply() -> None:
        status, report = await post_refresh(stack, mode="apply", config_yaml=grown)
        assert status == 200 and report["outcome"] == "applied", report

    async def ask(model: str) -> httpx2.Response:
        body = {"model": model, "messages": MESSAGES}
        async with stack.http() as http:
            answers[model] = answer = await http.post("/v1/chat/completions", json=body)
        return answer

    async with trio.open_nursery() as group:
        group.start_soon(apply)
        with trio.fail_after(WAIT_GUARD_S):
            await pushed.wait()
        group.start_soon(ask, "m2")
        with trio.fail_after(WAIT_GUARD_S):
            while scheduler.statistics().queued.get("m2", 0) == 0:
                await scheduler.wait_changed()
        assert targets == []  # the run waits on the Edge
        # the catalog says why: the Node has not applied it yet
        assert provider_in(await stack.catalog(), "sim-a")["unapplied"] == {"sim-large": "pending"}
        built.set()

    answer = answers["m2"]
    if applies:
        assert answer.status_code == 200, answer.text
        assert targets == ["sim-large"]
        assert provider_in(await stack.catalog(), "sim-a")["unapplied"] == {}
        return
    assert answer.status_code == 503, answer.text
    assert "refused the config" in answer.json()["error"]["message"]
    assert targets == []
    assert provider_in(await stack.catalog(), "sim-a")["unapplied"] == {"sim-large": "refused"}
    async with stack.admin() as admin:  # what it refused serves nothing; the rest serves
        assert (await admin.get("/readyz")).json()["servable_models"] == ["m"]
    # A Node that links again is welcomed with the running config: the model is its.
    first_node.cancel()
    await stack.wait_catalog(lambda c: not provider_in(c, "sim-a")["connected"])
    await nursery.start(node, trio.CancelScope())
    await stack.wait_catalog(lambda c: provider_in(c, "sim-a")["health"] == "available")
    answer = await ask("m2")
    assert answer.status_code == 200, answer.text
    assert targets == ["sim-large"]
    assert provider_in(await stack.catalog(), "sim-a")["unapplied"] == {}
    async with stack.admin() as admin:
        assert (await admin.get("/readyz")).json()["servable_models"] == ["m", "m2"]


_ANSWER = (
    b'{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
)


async def first_tokens(stream: openai.AsyncStream[ChatCompletionChunk]) -> list[str]:
    """Read a stream up to its first token (the run is then surely live on its Node)."""
    tokens: list[str] = []
    while not any(tokens):
        chunk = await stream.__anext__()
        tokens.extend(choice.delta.content or "" for choice in chunk.choices)
    return tokens


# --- 4. the config file, the audit log, SIGHUP ---------------------------------------------


async def test_inline_apply_writes_the_file_and_every_attempt_is_audited(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _one_provider_stack(nursery, tmp_path)
    original = stack.config_path.read_text(encoding="utf-8")
    candidate = _edit(original, set_provider("sim-a", capacity=5))
    audit_path = tmp_path / AUDIT_FILE_NAME

    status, _ = await post_refresh(stack, mode="dry_run", config_yaml=candidate)
    assert status == 200
    status, _ = await post_refresh(stack, mode="apply", config_yaml="nodes: 3")
    assert status == 400
    status, report = await post_refresh(stack, mode="apply", config_yaml=candidate)
    assert status == 200, report

    assert stack.config_path.read_text(encoding="utf-8") == candidate
    assert stack.config_path.with_name("edge.yaml.prev").read_text(encoding="utf-8") == original
    lines = [json.loads(line) for line in audit_path.read_text(encoding="utf-8").splitlines()]
    assert [(r["mode"], r["outcome"], r["verdict"]) for r in lines] == [
        ("dry_run", "dry_run", "accepted"),
        ("apply", "rejected", "invalid"),
        ("apply", "applied", "accepted"),
    ]
    applied = lines[-1]
    assert (applied["base_revision"], applied["revision"]) == (1, 2)
    assert applied["config_sha256"] == hashlib.sha256(candidate.encode()).hexdigest()
    assert applied["changed_paths"] == ["nodes[node-1].providers[sim-a].capacity"]
    assert [(n["id"], n["status"]) for n in applied["nodes"]] == [("node-1", "applied")]
    assert lines[1]["config_sha256"] is None and lines[1]["errors"]
    assert all(r["time"] for r in lines)


async def test_sighup_applies_the_file_on_disk(nursery: trio.Nursery, tmp_path: Path) -> None:
    """`_apply_from_file` is what the SIGHUP handler runs (iop_edge.main)."""
    stack = await _one_provider_stack(nursery, tmp_path)
    original = stack.config_path.read_text(encoding="utf-8")
    edited = _edit(original, set_provider("sim-a", capacity=7))
    stack.config_path.write_text(edited, encoding="utf-8")

    await _apply_from_file(stack.edge)

    assert stack.edge.snapshot.revision == 2
    assert provider_in(await get_json(stack, "/catalog"), "sim-a")["capacity"] == 7
    assert stack.config_path.read_text(encoding="utf-8") == edited
    assert not stack.config_path.with_name("edge.yaml.prev").exists()  # nothing to write back
    nodes = (await get_json(stack, "/status"))["nodes"]
    assert nodes[0]["applied_revision"] == 2

    # An invalid file is refused and changes nothing.
    stack.config_path.write_text(_edit(edited, set_provider("sim-a", capacity=0)), "utf-8")
    await _apply_from_file(stack.edge)
    assert stack.edge.snapshot.revision == 2


async def test_real_sighup_signal_refreshes(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _one_provider_stack(nursery, tmp_path)
    edited = _edit(stack.config_path.read_text(encoding="utf-8"), set_provider("sim-a", capacity=3))
    stack.config_path.write_text(edited, encoding="utf-8")
    # A SIGHUP that arrived before Trio's receiver was installed must not kill pytest.
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: None)
    try:
        async with trio.open_nursery() as watcher:
            watcher.start_soon(handle_signals, stack.edge, watcher.cancel_scope)
            await trio.testing.wait_all_tasks_blocked()  # the receiver is installed
            os.kill(os.getpid(), signal.SIGHUP)
            with trio.fail_after(WAIT_GUARD_S):
                while stack.edge.snapshot.revision == 1:
                    await stack.edge.wait_pool_change()
            # The refresh's push and audit are shielded: leaving waits for them.
            watcher.cancel_scope.cancel()
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert provider_in(await get_json(stack, "/catalog"), "sim-a")["capacity"] == 3
    audit = (tmp_path / AUDIT_FILE_NAME).read_text(encoding="utf-8").splitlines()
    assert json.loads(audit[-1])["outcome"] == "applied"
