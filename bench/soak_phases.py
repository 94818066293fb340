"""The soak's reliability phases, run one after the other once the mixed load's books
are printed (`python -m bench.soak`; `--no-phases` skips them, `--phase NAME` runs only
the named ones).

The mixed load covers the store filler (a principal filling the Responses store while
the others are served and metered), `store: false` reported when nothing was stored,
and the zero-downtime restart under callers without retries; each phase here stands up
its own Edge(s) and Node for seconds and checks one more behaviour under load or
hostility:

- `budgets` (`bench.soak_budgets`): a daily budget across two Edges sharing PostgreSQL;
- `fairness` (`bench.soak_fairness`): slot time shared by work at equal weights;
- `hostile` (`bench.soak_upstreams`): a runtime reusing Responses ids, malformed tool
  arguments, failed attempts refunded to `requests_per_minute`, no topology in errors;
- `runtime` (`bench.soak_upstreams`): a runtime that restarts, and one request shape
  answered with nothing;
- `limits` (`bench.soak_restart`): per-minute limits carried over a zero-downtime
  restart.

Each prints its books and its verdict; a phase that cannot run here (no PostgreSQL)
says it was skipped and why. The soak fails when any phase failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final

from bench.soak_budgets import budget_phase
from bench.soak_fairness import fairness_phase
from bench.soak_restart import restart_limits_phase
from bench.soak_stack import Verdict
from bench.soak_upstreams import hostile_replies_phase, runtime_restart_phase

__all__ = ["PHASES", "run_phases"]

PHASES: Final[dict[str, Callable[[Path], Awaitable[Verdict]]]] = {
    "budgets": budget_phase,
    "fairness": fairness_phase,
    "hostile": hostile_replies_phase,
    "runtime": runtime_restart_phase,
    "limits": restart_limits_phase,
}


async def run_phases(folder: Path, names: Sequence[str]) -> bool:
    """Run the phases `names` in order, each in its own subfolder of `folder`; print a
    closing line per phase; True when none failed."""
    verdicts = {name: await PHASES[name](folder / name) for name in names}
    print("\nreliability phases:")
    for name, verdict in verdicts.items():
        why = f" ({verdict.why})" if verdict.why else ""
        print(f"  {name:9s} {verdict.state}{why}")
    return not any(verdict.failed for verdict in verdicts.values())
