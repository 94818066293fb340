"""`python -m bench.usage_views`: `GET /usage` and `iop-edge usage` on a big ledger.

Builds a SQLite ledger of `--records` usage records (a million by default) in a temporary
`state_dir`, spread over `--groups` principal/token/model groups (each record its own
group by default: the worst case, where an unbounded view returns a row per record),
starts a real `iop-edge serve` on it, and measures:

- the default view (`GET /usage`: grouped by principal, token and model, the first page):
  seconds (best and median of `--repeat`) and bytes;
- the last page of the default view is not asked for: a page costs what it returns;
- `iop-edge usage` as an operator runs it: seconds and the CLI's peak resident memory;
- `GET /usage?group_by=model` (a grouping without its own index): seconds.

Exit status 0 when the default view answers within `--goal-s` (1 s), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
import yaml

from iop_edge.runtime.metering.ledger import SQLITE_FILE
from iop_edge.runtime.metering.usage_ledger.ledger_sqlite import SqliteStore

REPO = Path(__file__).resolve().parents[1]
_ADMIN = re.compile(r"admin API listening on (\S+)")


def build_ledger(path: Path, records: int, groups: int) -> float:
    """Write the ledger with executemany; returns the seconds it took."""
    started = time.perf_counter()
    store = SqliteStore(path)
    store.open()  # the schema and its indexes, as an Edge makes them
    store.close()
    rows = (
        (1_700_000_000.0 + i, f"run-{i}", f"team-{i % groups}", f"app-{i % groups}", None,
         f"model-{i % 7}", "gpu1-vllm", "gpu1", 120, 380, 200, 850.0, 95.0, "provider", "chat", 96)
        for i in range(records)
    )  # fmt: skip
    with sqlite3.connect(path) as db:
        db.executemany(f"INSERT INTO usage VALUES ({', '.join('?' * 16)})", rows)
    return time.perf_counter() - started


def start_edge(state_dir: Path, config_path: Path) -> tuple[subprocess.Popen[str], str]:
    config = {
        "edge": {"listen": "127.0.0.1:0", "state_dir": str(state_dir)},
        "admin": {"listen": "127.0.0.1:0"},
        "openai": {"listen": "127.0.0.1:0"},
        "models": [{"id": "m", "providers": {"sim-1": "sim-small"}}],
        "nodes": [
            {
                "id": "node-1",
                "token_hash_sha256": "0" * 64,
                "providers": [
                    {"id": "sim-1", "type": "sim", "models": ["sim-small"], "capacity": 1}
                ],
            }
        ],
    }
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    process = subprocess.Popen(
        [sys.executable, "-m", "iop_edge", "serve", "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    for line in process.stdout:
        if match := _ADMIN.search(line):
            return process, match.group(1)
    raise SystemExit(f"the Edge did not start (exit {process.wait()})")


def timed_get(client: httpx2.Client, url: str) -> tuple[float, int]:
    started = time.perf_counter()
    response = client.get(url)
    response.raise_for_status()
    return time.perf_counter() - started, len(response.content)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.usage_views", description=__doc__)
    parser.add_argument("--records", type=int, default=1_000_000, help="ledger records")
    parser.add_argument(
        "--groups", type=int, default=0, help="distinct groups (default: one per record)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="requests per measurement")
    parser.add_argument("--goal-s", type=float, default=1.0, help="the default view's goal")
    args = parser.parse_args(argv)
    groups = args.groups or args.records
    with tempfile.TemporaryDirectory(prefix="iop-usage-views-") as folder:
        state_dir = Path(folder) / "state"
        state_dir.mkdir()
        built_s = build_ledger(state_dir / SQLITE_FILE, args.records, groups)
        process, admin_url = start_edge(state_dir, Path(folder) / "edge.yaml")
        try:
            with httpx2.Client(base_url=admin_url, timeout=600) as client:
                default = [timed_get(client, "/usage") for _ in range(args.repeat)]
                by_model = [timed_get(client, "/usage?group_by=model") for _ in range(args.repeat)]
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            started = time.perf_counter()
            cli = subprocess.run(
                [sys.executable, "-m", "iop_edge", "usage", "--admin", admin_url],
                capture_output=True,
                text=True,
                cwd=REPO,
                check=False,
            )
            cli_s = time.perf_counter() - started
            cli_rss_kib = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        finally:
            process.terminate()
            process.wait(timeout=30)
    seconds = [elapsed for elapsed, _ in default]
    best, median = min(seconds), statistics.median(seconds)
    print(f"ledger: {args.records:,} records in {groups:,} groups, built in {built_s:.1f}s")
    print(
        f"GET /usage (default view, first page): best {best * 1000:.0f} ms, median "
        f"{median * 1000:.0f} ms, {default[0][1]:,} bytes"
    )
    model_s = statistics.median(elapsed for elapsed, _ in by_model)
    print(f"GET /usage?group_by=model: median {model_s * 1000:.0f} ms")
    print(
        f"iop-edge usage: exit {cli.returncode} in {cli_s:.2f}s, peak RSS of the "
        f"processes it ran at most {cli_rss_kib / 1024:.0f} MiB, {len(cli.stdout):,} characters"
    )
    ok = median <= args.goal_s and cli.returncode == 0
    print(f"goal: the default view within {args.goal_s:g}s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
