"""The soak's upstream phases: runtimes that misbehave (`bench.hostile_upstream`).

**Hostile replies** (one Edge, one Node; cooldown set out of reach, so each check sees
the reply it provoked, not a provider cooling down):

- *ids*: `CONVERSATIONS` Responses conversations of three turns on a runtime that
  answers every request with one id. Every turn is stored under an id of IOP's own:
  all distinct, none the runtime's, each retrieved with its own text (`turn N`: none
  overwritten), and the first turn continued again once the third exists.
- *malformed tool arguments*: Messages and Responses streams whose upstream tool call
  arguments are no JSON end with the protocol's error event (`event: error`,
  `response.failed`), never `message_stop` / `response.completed`.
- *refund*: a principal with `requests_per_minute: RPM` sends `FAILED` requests its
  runtime answers 500 (each a 502), then `RPM` that are answered: all `RPM` are 200 (the
  failed attempts were given back) and the next is a 429.
- *topology*: no caller-visible error body or error event (all of the above, and a
  provider whose runtime is gone, in every protocol) names a provider, the Node, a host
  or a port.

**Runtime restart and request shapes** (one Edge, one Node, `dispatch.cooldown` at its
defaults, the periodic probe `HEALTH_INTERVAL_S` away):

- *empty reply*: `EMPTY_SHAPE_REQUESTS` requests in a row of the one shape the runtime
  answers with an empty 200 stream (tools with `tool_choice: "auto"`) fail alone (502):
  the provider does not cool down, and the other requests after them are all served;
- *back after a probe found it down*: a runtime down when its Node probed it (callers
  are refused at once, 503) comes back on its port; a caller sending requests one after
  the other, without retries, is served at its probe on demand;
- *back after callers found it down*: a runtime that stops under its callers (their
  runs fail to connect, then the provider cools down) comes back; the same caller is
  served once the cooldown ends.

Each reports the time from the runtime's return to the first success; the phase holds
when both are within `BACK_WITHIN_S`, far sooner than the periodic probe.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import httpx2
import trio

from bench.hostile_upstream import (
    FAIL_MARK,
    MALFORMED_TOOL,
    REUSED_ID,
    SERVED,
    HostileUpstream,
    turn_text,
)
from bench.soak_stack import (
    NODE_ID,
    Verdict,
    caller_token,
    error_code,
    principal_tokens,
    start_phase_stack,
)

__all__ = ["hostile_replies_phase", "runtime_restart_phase"]

CONVERSATIONS: Final = 4
RPM: Final = 3
FAILED: Final = 6
HEALTH_INTERVAL_S: Final = 60.0
BACK_WITHIN_S: Final = 10.0
EMPTY_SHAPE_REQUESTS: Final = 5
#: Between two requests of a caller waiting for a runtime to come back.
_RETRY_PAUSE_S: Final = 0.05
#: The defaults of `dispatch.cooldown`, written out: what an operator runs with.
COOLDOWN_FAILURES: Final = 3
COOLDOWN_S: Final = 5.0
_CALLER: Final = "alice"
_RETRIER: Final = "retrier"
_ASK: Final = [{"role": "user", "content": "x"}]
_TOOLS_CHAT: Final = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def _provider(provider_id: str, base_url: str, protocols: list[str]) -> dict[str, Any]:
    adapter = {
        "base_url": base_url,
        "protocols": protocols,
        "health_interval_s": HEALTH_INTERVAL_S,
        "request_timeout_s": 60.0,
        "first_byte_timeout_s": 30.0,
    }
    return {"id": provider_id, "type": "vllm", "models": [SERVED], "capacity": 4,
            "adapter": adapter}  # fmt: skip


def _headers(principal: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {caller_token(principal)}"}


async def _sse(
    http: httpx2.AsyncClient, path: str, body: dict[str, Any], principal: str = _CALLER
) -> tuple[int, list[tuple[str, str]]]:
    """A stream request: its status and its (event name, data) pairs, or the error body
    as one ("", body) pair when it was refused."""
    events: list[tuple[str, str]] = []
    async with http.stream("POST", path, json=body, headers=_headers(principal)) as response:
        if response.status_code != 200:
            return response.status_code, [("", (await response.aread()).decode())]
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
                if not name and data != "[DONE]":
                    try:
                        name = str(json.loads(data).get("type", ""))
                    except ValueError:
                        name = "?"
                events.append((name, data))
                name = ""
    return 200, events


def _leaks(texts: Iterable[str], topology: Iterable[str]) -> list[str]:
    """Each name of `topology` a text says, as `name in text` lines."""
    return [f"{name!r} in {text[:120]!r}" for text in texts for name in topology if name in text]


# --- hostile replies -------------------------------------------------------------------------


async def hostile_replies_phase(folder: Path) -> Verdict:
    """Run the hostile-replies phase (module docstring) in `folder`; print its books."""
    print("\nhostile upstream replies:")
    async with trio.open_nursery() as nursery:
        runtime, gone = HostileUpstream(nursery), HostileUpstream(nursery)
        runtime_url, gone_url = await runtime.start(), await gone.start()
        config = {
            "openai": principal_tokens([_CALLER, _RETRIER]),
            "principals": [{"ref": _RETRIER, "requests_per_minute": RPM}],
            "dispatch": {"cooldown": {"failures": 1000, "seconds": 1}},
            "models": [
                {"id": "m-reuse", "providers": {"reuse-1": SERVED}},
                {"id": "m-hostile", "providers": {"hostile-1": SERVED}},
                {"id": "m-gone", "providers": {"gone-1": SERVED}},
            ],
            "providers": [
                _provider("reuse-1", runtime_url, ["chat", "responses"]),
                _provider("hostile-1", runtime_url, ["chat"]),
                _provider("gone-1", gone_url, ["chat"]),
            ],
        }
        stack = await start_phase_stack(nursery, folder, [config])
        await gone.stop()  # its runtime is gone from here on
        topology = ["reuse-1", "hostile-1", "gone-1", NODE_ID, "127.0.0.1", "localhost"]
        topology += [f":{runtime.port}", f":{gone.port}"]
        async with httpx2.AsyncClient(base_url=stack.urls.openai, timeout=60) as http:
            ids_held = await _ids(http)
            malformed_held, malformed_texts = await _malformed(http)
            refund_held, refund_texts = await _refund(http)
            gone_held, gone_texts = await _gone(http)
        nursery.cancel_scope.cancel()
    leaks = _leaks([*malformed_texts, *refund_texts, *gone_texts], topology)
    checked = len(malformed_texts) + len(refund_texts) + len(gone_texts)
    print(
        f"  topology: {checked} caller-visible error bodies and events, {len(leaks)} "
        "naming a provider, the node, a host or a port"
    )
    for leak in leaks[:5]:
        print(f"    {leak}")
    verdict = Verdict.of(ids_held and malformed_held and refund_held and gone_held and not leaks)
    print(f"  {verdict.state}")
    return verdict


async def _ids(http: httpx2.AsyncClient) -> bool:
    """Conversations on a runtime that reuses one id (module docstring)."""
    turns: list[tuple[str, int]] = []  # (IOP's id, user turns it answered)
    failures: list[str] = []
    for conversation in range(CONVERSATIONS):
        previous: str | None = None
        for turn in (1, 2, 3):
            body: dict[str, Any] = {"model": "m-reuse", "input": f"c{conversation} t{turn}"}
            if previous is not None:
                body["previous_response_id"] = previous
            response = await http.post("/v1/responses", json=body, headers=_headers(_CALLER))
            if response.status_code != 200:
                failures.append(
                    f"turn {turn}: {response.status_code} {error_code(response.content)}"
                )
                break
            previous = response.json()["id"]
            turns.append((previous, turn))
    retrieved = 0
    for response_id, turn in turns:
        got = await http.get(f"/v1/responses/{response_id}", headers=_headers(_CALLER))
        text = got.json()["output"][0]["content"][0]["text"] if got.status_code == 200 else ""
        if got.json().get("id") == response_id and text == turn_text(turn):
            retrieved += 1
        else:
            failures.append(
                f"{response_id}: {got.status_code} {text!r}, stored {turn_text(turn)!r}"
            )
    branched = 0
    for response_id, turn in turns:
        if turn == 1:  # continued again after its conversation went on
            body = {"model": "m-reuse", "input": "again", "previous_response_id": response_id}
            again = await http.post("/v1/responses", json=body, headers=_headers(_CALLER))
            if again.status_code == 200 and again.json()["output"][0]["content"][0][
                "text"
            ] == turn_text(2):
                branched += 1
    ids = [response_id for response_id, _ in turns]
    distinct = len(set(ids)) == len(ids) == 3 * CONVERSATIONS and REUSED_ID not in ids
    print(
        f"  ids: {len(ids)} turns stored from a runtime that answers every one {REUSED_ID!r}: "
        f"{len(set(ids))} distinct ids, {retrieved} retrieved with their own text, "
        f"{branched} of {CONVERSATIONS} first turns continued again"
    )
    for failure in failures[:3]:
        print(f"    {failure}")
    return distinct and retrieved == len(ids) and branched == CONVERSATIONS and not failures


async def _malformed(http: httpx2.AsyncClient) -> tuple[bool, list[str]]:
    """Streams whose upstream tool arguments are no JSON; the texts the callers saw."""
    ends: Counter[str] = Counter()
    texts: list[str] = []
    messages_tools = [{"name": MALFORMED_TOOL, "input_schema": {"type": "object"}}]
    responses_tools = [{"type": "function", "name": MALFORMED_TOOL, "parameters": {}}]
    for _ in range(3):
        for path, body in (
            ("/v1/messages", {"model": "m-hostile", "max_tokens": 40, "stream": True,
                              "messages": [{"role": "user", "content": "read a.txt"}],
                              "tools": messages_tools}),
            ("/v1/responses", {"model": "m-hostile", "input": "read a.txt", "stream": True,
                               "tools": responses_tools}),
        ):  # fmt: skip
            status, events = await _sse(http, path, body)
            names = [name for name, _ in events]
            last = names[-1] if names else "nothing"
            normal_end = {"message_stop", "response.completed"} & set(names)
            ends[
                f"{path} {status} last event {last}{' AND a normal end' if normal_end else ''}"
            ] += 1
            texts += [data for name, data in events if "error" in name or "failed" in name]
    body = {"model": "m-hostile", "max_tokens": 40, "tools": messages_tools,
            "messages": [{"role": "user", "content": "read a.txt"}]}  # fmt: skip
    whole = await http.post("/v1/messages", json=body, headers=_headers(_CALLER))
    texts.append(whole.text)
    ends[f"/v1/messages non-stream {whole.status_code} {error_code(whole.content)}"] += 1
    summary = ", ".join(f"{count} {end}" for end, count in sorted(ends.items()))
    print(f"  malformed tool arguments: {summary}")
    held = set(ends) == {
        "/v1/messages 200 last event error",
        "/v1/responses 200 last event response.failed",
        "/v1/messages non-stream 502 api_error",
    }
    return held, texts


async def _refund(http: httpx2.AsyncClient) -> tuple[bool, list[str]]:
    """Failed upstream attempts spend none of `requests_per_minute`."""
    ends: list[str] = []
    texts: list[str] = []
    for index in range(FAILED + RPM + 1):
        content = FAIL_MARK if index < FAILED else "hello"
        body = {"model": "m-hostile", "messages": [{"role": "user", "content": content}],
                "stream": index % 2 == 1}  # fmt: skip
        status, events = await _sse(http, "/v1/chat/completions", body, _RETRIER)
        code = error_code(events[0][1]) if status != 200 else ""
        ends.append(f"{status} {code}".strip())
        if status != 200:
            texts.append(events[0][1])
    expected = ["502 upstream_error"] * FAILED + ["200"] * RPM + ["429 rate_limit_requests"]
    print(
        f"  refund: requests_per_minute {RPM}; {FAILED} requests the runtime failed, then "
        f"{RPM + 1} it answered: {', '.join(f'{n} {end}' for end, n in Counter(ends).items())}"
    )
    if ends != expected:
        print(f"    in order: {ends}; expected {expected}")
    return ends == expected, texts


async def _gone(http: httpx2.AsyncClient) -> tuple[bool, list[str]]:
    """Every protocol's error for a provider whose runtime is gone."""
    texts: list[str] = []
    statuses: Counter[int] = Counter()
    for path, body in (
        ("/v1/chat/completions", {"model": "m-gone", "messages": _ASK}),
        ("/v1/chat/completions", {"model": "m-gone", "stream": True, "messages": _ASK}),
        ("/v1/messages", {"model": "m-gone", "max_tokens": 5, "messages": _ASK}),
        ("/v1/responses", {"model": "m-gone", "input": "x", "stream": True}),
    ):  # fmt: skip
        response = await http.post(path, json=body, headers=_headers(_CALLER))
        statuses[response.status_code] += 1
        texts.append(response.text)
    print(
        f"  runtime gone: {', '.join(f'{n} x {s}' for s, n in statuses.items())} over 3 protocols"
    )
    return set(statuses) <= {502, 503}, texts


# --- runtime restart and request shapes ---------------------------------------------------------


async def runtime_restart_phase(folder: Path) -> Verdict:
    """Run the restart phase (module docstring) in `folder`; print its books."""
    print("\nruntime restart and request shapes:")
    async with trio.open_nursery() as nursery:
        runtime, late = HostileUpstream(nursery), HostileUpstream(nursery)
        runtime_url, late_url = await runtime.start(), await late.start()
        await late.stop()  # down when the Node first probes it
        config = {
            "dispatch": {"cooldown": {"failures": COOLDOWN_FAILURES, "seconds": COOLDOWN_S}},
            "models": [
                {"id": "m", "providers": {"llama-1": SERVED}},
                {"id": "m-late", "providers": {"llama-2": SERVED}},
            ],
            "providers": [
                _provider("llama-1", runtime_url, ["chat"]),
                _provider("llama-2", late_url, ["chat"]),
            ],
        }
        stack = await start_phase_stack(nursery, folder, [config], down=["llama-2"])
        async with (
            httpx2.AsyncClient(base_url=stack.urls.openai, timeout=60) as http,
            httpx2.AsyncClient(base_url=stack.urls.admin, timeout=60) as admin,
        ):
            shape_held = await _empty_shape(http, admin)
            probed_held = await _back_after_probe(http, late)
            failed_held = await _back_after_failures(http, admin, runtime)
        nursery.cancel_scope.cancel()
    verdict = Verdict.of(shape_held and probed_held and failed_held)
    print(f"  {verdict.state}")
    return verdict


async def _empty_shape(http: httpx2.AsyncClient, admin: httpx2.AsyncClient) -> bool:
    shape: Counter[int] = Counter()
    others: Counter[int] = Counter()
    body = {"model": "m", "messages": [{"role": "user", "content": "call f"}], "stream": True,
            "tools": _TOOLS_CHAT, "tool_choice": "auto"}  # fmt: skip
    for _ in range(EMPTY_SHAPE_REQUESTS):  # a client retrying the one shape, in a row
        status, _ = await _sse(http, "/v1/chat/completions", body)
        shape[status] += 1
    entry = await _provider_entry(admin)
    for _ in range(2 * EMPTY_SHAPE_REQUESTS):
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hello"}]},
        )
        others[answer.status_code] += 1
    print(
        f"  empty streamed 200 for one request shape: that shape {dict(shape)} in a row "
        f"(cooldown after {COOLDOWN_FAILURES} failures), then the provider "
        f"cooling_down={entry['cooling_down']}, consecutive_failures="
        f"{entry['consecutive_failures']}; the other requests after them {dict(others)}"
    )
    return (
        set(shape) == {502}
        and set(others) == {200}
        and not entry["cooling_down"]
        and entry["consecutive_failures"] == 0
    )


async def _provider_entry(admin: httpx2.AsyncClient) -> dict[str, Any]:
    catalog = (await admin.get("/catalog")).json()
    entry: dict[str, Any] = next(p for p in catalog["providers"] if p["id"] == "llama-1")
    return entry


async def _until_served(http: httpx2.AsyncClient, model: str) -> tuple[float | None, str]:
    """Requests one after the other (each `_RETRY_PAUSE_S` after the last ended), none
    retried, until one is served: seconds from now to that success (None: none within
    the periodic probe's interval), and a summary of the refusals before it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    back = time.monotonic()
    refused: Counter[str] = Counter()
    with trio.move_on_after(HEALTH_INTERVAL_S):
        while True:
            response = await http.post("/v1/chat/completions", json=body)
            if response.status_code == 200:
                return time.monotonic() - back, _summary(refused) or "none refused"
            refused[f"{response.status_code} {error_code(response.content)}"] += 1
            await trio.sleep(_RETRY_PAUSE_S)
    return None, _summary(refused)


def _summary(ends: Counter[str]) -> str:
    return ", ".join(f"{count} {end}" for end, count in ends.most_common())


def _seconds(value: float | None) -> str:
    return f"{value:.2f}s" if value is not None else f"none within {HEALTH_INTERVAL_S:g}s"


async def _back_after_probe(http: httpx2.AsyncClient, runtime: HostileUpstream) -> bool:
    """A runtime its periodic probe found down comes back: routable at the next
    caller's probe on demand, not the next periodic one."""
    body = {"model": "m-late", "messages": [{"role": "user", "content": "hello"}]}
    response = await http.post("/v1/chat/completions", json=body)
    down = f"{response.status_code} {error_code(response.content)}"
    await runtime.start()
    first, refused = await _until_served(http, "m-late")
    print(
        f"  runtime found down by its probe: a caller gets {down}; back on its port, "
        f"first success after {_seconds(first)} ({refused} before it; periodic probe "
        f"every {HEALTH_INTERVAL_S:g}s)"
    )
    return down == "503 no_provider" and first is not None and first <= BACK_WITHIN_S


async def _back_after_failures(
    http: httpx2.AsyncClient, admin: httpx2.AsyncClient, runtime: HostileUpstream
) -> bool:
    """A runtime callers found down (its runs failed to connect) comes back: routable
    once its cooldown ends, without waiting for a periodic probe."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    await runtime.stop()
    down: Counter[str] = Counter()
    for _ in range(COOLDOWN_FAILURES + 1):  # while it is down: refused at once
        response = await http.post("/v1/chat/completions", json=body)
        down[f"{response.status_code} {error_code(response.content)}"] += 1
    entry = await _provider_entry(admin)
    await runtime.start()
    first, refused = await _until_served(http, "m")
    print(
        f"  runtime found down by callers: {_summary(down)} (then {entry['health']}, "
        f"cooling_down={entry['cooling_down']}); back on its port, first success after "
        f"{_seconds(first)} ({refused} before it; cooldown {COOLDOWN_S:g}s)"
    )
    return first is not None and first <= BACK_WITHIN_S
