"""`python -m bench --tokens N`: what N caller tokens cost the Edge, at startup and in a refresh.

Two Edge configs alike but for their callers: a *small* one with `SMALL_TOKENS` tokens,
and a *large* one with N `openai.principal_tokens` entries (each its own sha256, two per
principal) and a `principals:` list giving each principal its own limits (allow-list,
concurrency, requests per minute, daily budget) besides a `"*"` entry. Measured
from outside, as an operator sees it:

- **startup**: from spawning `python -m iop_edge serve` until the Edge has logged its
  three listeners, for each config in turn, `starts` times; the least of each is kept
  (the machine's other work only ever adds to a start). The same for `iop-edge
  check-config`, which reads and validates the config and nothing else.
- **stall**: while the large Edge runs a refresh dry run of a candidate that changes the
  limits of every listed principal (a live change: validating, planning and the report,
  what a refresh costs before any Node is involved), one client sends `GET /healthz` to
  the caller API, one request after the other. The slowest answer is how long the dry
  run held other callers' requests. The same pings for a window of as long without a
  refresh are the control: what this machine's noise alone costs a request.

Targets: the large startup at most `STARTUP_RATIO_TARGET` times the small one; no
request held more than `STALL_TARGET_S` during a dry run.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx2
import trio
import yaml
from rich.table import Table

from bench.gateway import EdgeLog
from bench.load import percentile
from bench.services import admin_headers, child_env, python_argv, start_service

__all__ = [
    "STALL_TARGET_S",
    "STARTUP_RATIO_TARGET",
    "ManyTokensMeasurement",
    "ManyTokensShape",
    "caller_tokens",
    "measure_many_tokens",
    "render_many_tokens",
    "tokens_config",
]

SMALL_TOKENS: Final = 2
STARTUP_RATIO_TARGET: Final = 2.0
STALL_TARGET_S: Final = 0.050
#: A start or a check that takes longer than this has failed.
_START_DEADLINE_S: Final = 120.0
_ADMIN_TIMEOUT_S: Final = 120.0
#: Pings before measuring: the connection is open and the Edge's paths are warm.
_WARMUP_PINGS: Final = 50
#: Once the work ends, the ping in flight is waited for (it may be the one held).
_LAST_PING_DEADLINE_S: Final = 10.0
#: The one Node entry's token: never presented (no Node connects), only its hash written.
_NODE_TOKEN_SHA256: Final = hashlib.sha256(b"bench-many-tokens: no node connects").hexdigest()

T = TypeVar("T")

try:  # libyaml's emitter: ten thousand entries take a while with the pure-Python one
    _Dumper: Any = yaml.CSafeDumper
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Dumper = yaml.SafeDumper


@dataclass(frozen=True, slots=True)
class ManyTokensShape:
    tokens: int = 10_000
    tokens_per_principal: int = 2
    limited_every: int = 1
    """One principal in this many has a `principals:` entry of its own (1: each)."""
    models: int = 10
    starts: int = 3
    dry_runs: int = 3

    def __post_init__(self) -> None:
        if min(self.tokens, self.tokens_per_principal, self.limited_every) < 1:
            raise ValueError("tokens, tokens per principal and limited-every must be >= 1")
        if min(self.models, self.starts, self.dry_runs) < 1:
            raise ValueError("models, starts and dry runs must be >= 1")

    @property
    def principals(self) -> int:
        return -(-self.tokens // self.tokens_per_principal)

    @property
    def limited(self) -> int:
        """Principals with an entry of their own in `principals:`."""
        return -(-self.principals // self.limited_every)


@dataclass(frozen=True, slots=True)
class ManyTokensMeasurement:
    shape: ManyTokensShape
    config_bytes: int
    """The large config's size."""
    startup_small_s: float
    startup_large_s: float
    check_small_s: float
    check_large_s: float
    dry_run_s: tuple[float, ...]
    """Each dry run's time, until the Edge answered."""
    dry_run_changes: int
    """Changes the dry run's report lists (every listed principal's limit)."""
    pings_during: tuple[float, ...]
    """Every ping's latency while a dry run ran, sorted."""
    pings_control: tuple[float, ...]
    """... and with no refresh running, sorted."""

    @property
    def startup_ratio(self) -> float:
        return self.startup_large_s / self.startup_small_s

    @property
    def stall_s(self) -> float | None:
        """The longest a request waited during a dry run; None: no ping was answered."""
        return self.pings_during[-1] if self.pings_during else None

    @property
    def control_s(self) -> float | None:
        return self.pings_control[-1] if self.pings_control else None

    def ping_ms(self, q: float, *, during: bool = True) -> float | None:
        pings = self.pings_during if during else self.pings_control
        return percentile(pings, q) * 1000 if pings else None


# --- the configs ----------------------------------------------------------------------------------


def caller_tokens(count: int, per_principal: int) -> list[dict[str, str]]:
    """`count` principal token entries, `per_principal` to a principal. The tokens
    themselves are random and thrown away: only their sha256 is written, as an
    operator's config holds them."""
    return [
        {
            "token_ref": f"token-{i:05d}",
            "token_hash_sha256": hashlib.sha256(secrets.token_bytes(16)).hexdigest(),
            "principal_ref": f"principal-{i // per_principal:05d}",
        }
        for i in range(count)
    ]


def tokens_config(
    shape: ManyTokensShape, state_dir: Path, principal_tokens: list[dict[str, str]], *, rpm: int
) -> str:
    """An Edge config (YAML) with these caller tokens and `shape`'s principal limits,
    every listed principal at `rpm` requests per minute."""
    principals = -(-len(principal_tokens) // shape.tokens_per_principal)
    limits: list[dict[str, Any]] = [
        {
            "ref": f"principal-{p:05d}",
            "models": ["model-*"],
            "max_concurrent": 4,
            "requests_per_minute": rpm,
            "tokens_per_day": 1_000_000,
        }
        for p in range(0, principals, shape.limited_every)
    ]
    limits.append({"ref": "*", "requests_per_minute": 60, "tokens_per_minute": 100_000})
    config = {
        "edge": {"id": "bench-edge", "listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0", "principal_tokens": principal_tokens},
        "models": [
            {"id": f"model-{m}", "providers": {"bench-sim": "sim-small"}}
            for m in range(shape.models)
        ],
        "nodes": [
            {
                "id": "bench-node",
                "token_hash_sha256": _NODE_TOKEN_SHA256,
                "providers": [
                    {"id": "bench-sim", "type": "sim", "models": ["sim-small"], "capacity": 4}
                ],
            }
        ],
        "principals": limits,
    }
    text: str = yaml.dump(config, Dumper=_Dumper, sort_keys=False)
    return text


# --- the measurement ------------------------------------------------------------------------------


def _edge_argv(config: Path) -> list[str]:
    # INFO: the Edge logs the URLs it bound at INFO.
    return python_argv("iop_edge", "serve", "--config", str(config), "--log-level", "INFO")


async def _startup_s(config: Path) -> float:
    """Seconds from spawning the Edge until it has logged its three listeners."""
    async with trio.open_nursery() as scope:
        began = time.perf_counter()
        with trio.fail_after(_START_DEADLINE_S):
            await start_service(scope, "iop-edge (startup)", _edge_argv(config), EdgeLog())
        elapsed = time.perf_counter() - began
        scope.cancel_scope.cancel()
    return elapsed


async def _check_s(config: Path) -> float:
    """Seconds `iop-edge check-config` takes on `config`; it must find it valid."""
    began = time.perf_counter()
    with trio.fail_after(_START_DEADLINE_S):
        done = await trio.run_process(
            python_argv("iop_edge", "check-config", str(config)),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=child_env(),
        )
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
        raise RuntimeError(f"check-config refused the bench's config {config}:\n{tail}")
    return elapsed


async def _pinged(
    client: httpx2.AsyncClient, work: Callable[[], Awaitable[T]]
) -> tuple[T, list[float]]:
    """`work()`'s result, and the latency of every `GET /healthz` sent one after the
    other while it ran (the one in flight when it ends included)."""
    latencies: list[float] = []
    done = trio.Event()
    result: list[T] = []

    async def ping() -> None:
        while not done.is_set():
            began = time.perf_counter()
            response = await client.get("/healthz")
            latencies.append(time.perf_counter() - began)
            response.raise_for_status()

    async def run_work() -> None:
        try:
            result.append(await work())
        finally:
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ping)
        nursery.start_soon(run_work)
        await done.wait()
        nursery.cancel_scope.deadline = trio.current_time() + _LAST_PING_DEADLINE_S
    return result[0], latencies


async def _dry_run(admin: httpx2.AsyncClient, candidate: str) -> tuple[float, int]:
    """(seconds, changes reported) of one dry run of `candidate`."""
    body = json.dumps({"mode": "dry_run", "config_yaml": candidate})
    began = time.perf_counter()
    response = await admin.post(
        "/refresh", content=body, headers={"content-type": "application/json"}
    )
    elapsed = time.perf_counter() - began
    if response.status_code != 200:
        raise RuntimeError(f"the dry run was refused: HTTP {response.status_code}: "
                           f"{response.text[:500]}")  # fmt: skip
    return elapsed, len(response.json().get("changes", []))


async def measure_many_tokens(
    shape: ManyTokensShape, workdir: Path, say: Callable[[str], None] = lambda line: None
) -> ManyTokensMeasurement:
    """Write both configs, time their starts and checks, then the stall of dry runs on the
    large one; `say` hears the progress. Each start and check has a deadline of its own."""
    await trio.Path(workdir).mkdir(parents=True, exist_ok=True)
    small = workdir / "small.yaml"
    large = workdir / "large.yaml"
    state = workdir / "edge-state"
    principal_tokens = caller_tokens(shape.tokens, shape.tokens_per_principal)
    large_text = tokens_config(shape, state, principal_tokens, rpm=600)
    candidate = tokens_config(shape, state, principal_tokens, rpm=601)  # limits: live
    small_tokens = caller_tokens(SMALL_TOKENS, shape.tokens_per_principal)
    await trio.Path(small).write_text(
        tokens_config(shape, state, small_tokens, rpm=600), encoding="utf-8"
    )
    await trio.Path(large).write_text(large_text, encoding="utf-8")

    say(
        f"tokens: {shape.tokens:,} caller tokens, {shape.limited:,} principals with limits "
        f"({_size(len(large_text))} of YAML) against {SMALL_TOKENS} tokens"
    )
    starts: dict[Path, list[float]] = {small: [], large: []}
    for _ in range(shape.starts):
        for config in (small, large):  # interleaved: a slow minute weighs on both alike
            starts[config].append(await _startup_s(config))
    say(f"tokens: startup {min(starts[small]):.2f} s small, {min(starts[large]):.2f} s large")
    check_small = min([await _check_s(small) for _ in range(shape.starts)])
    check_large = min([await _check_s(large) for _ in range(shape.starts)])

    dry_runs: list[float] = []
    during: list[float] = []
    control: list[float] = []
    changes = 0
    async with trio.open_nursery() as scope:
        edge = await start_service(scope, "iop-edge (many tokens)", _edge_argv(large), EdgeLog())
        async with (
            httpx2.AsyncClient(base_url=edge.ready.openai, timeout=_ADMIN_TIMEOUT_S) as caller,
            httpx2.AsyncClient(
                base_url=edge.ready.admin, timeout=_ADMIN_TIMEOUT_S, headers=admin_headers(state)
            ) as admin,
        ):
            for _ in range(_WARMUP_PINGS):
                (await caller.get("/healthz")).raise_for_status()
            for _ in range(shape.dry_runs):
                (elapsed, changes), pings = await _pinged(
                    caller, partial(_dry_run, admin, candidate)
                )
                dry_runs.append(elapsed)
                during.extend(pings)
                say(f"tokens: dry run {elapsed:.2f} s, slowest request {max(pings) * 1000:.1f} ms")
                _, quiet = await _pinged(caller, partial(trio.sleep, elapsed))
                control.extend(quiet)
        scope.cancel_scope.cancel()
    return ManyTokensMeasurement(
        shape=shape,
        config_bytes=len(large_text.encode()),
        startup_small_s=min(starts[small]),
        startup_large_s=min(starts[large]),
        check_small_s=check_small,
        check_large_s=check_large,
        dry_run_s=tuple(dry_runs),
        dry_run_changes=changes,
        pings_during=tuple(sorted(during)),
        pings_control=tuple(sorted(control)),
    )


# --- the report -----------------------------------------------------------------------------------


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def render_many_tokens(m: ManyTokensMeasurement) -> Table:
    shape = m.shape
    table = Table(
        title=(
            f"Many caller tokens: {shape.tokens:,} tokens of {shape.principals:,} principals, "
            f"{shape.limited:,} with limits of their own ({_size(m.config_bytes)} of YAML), "
            f"against a config of {SMALL_TOKENS} tokens"
        ),
        title_justify="left",
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("", justify="left")
    table.add_row("startup, small config", f"{m.startup_small_s:.2f} s", "", "")
    table.add_row(
        f"startup, {shape.tokens:,} tokens",
        f"{m.startup_large_s:.2f} s = {m.startup_ratio:.2f} x small",
        f"≤ {STARTUP_RATIO_TARGET:g} x small",
        _verdict(m.startup_ratio <= STARTUP_RATIO_TARGET),
    )
    table.add_row(
        "check-config, small / large",
        f"{m.check_small_s:.2f} s / {m.check_large_s:.2f} s",
        "",
        "",
    )
    table.add_row(
        f"refresh dry run ({m.dry_run_changes:,} changes)",
        " / ".join(f"{s:.2f}" for s in m.dry_run_s) + " s",
        "",
        "",
    )
    stall = m.stall_s
    p50 = m.ping_ms(50)
    table.add_row(
        "request held during a dry run: max (p50)",
        "-" if stall is None else f"{stall * 1000:.1f} ms ({p50 or 0:.1f} ms)",
        f"≤ {STALL_TARGET_S * 1000:g} ms",
        "n/a" if stall is None else _verdict(stall <= STALL_TARGET_S),
    )
    control = m.control_s
    control_p50 = m.ping_ms(50, during=False)
    table.add_row(
        "... the same with no refresh (control)",
        "-" if control is None else f"{control * 1000:.1f} ms ({control_p50 or 0:.1f} ms)",
        "",
        "",
    )
    return table
