"""The Edge's refresh worker process: `runtime.refresh.worker` with the usage ledger's
check (its Rule 7), which the refresh cannot import itself (the ledger is another room
of the runtime).

    python -m iop_edge.procedures.refresh_worker

The ledger's modules are imported only when a candidate moves the ledger: they bring the
event loop's library, which the worker otherwise leaves out (its start costs half as
much CPU without it).
"""

from __future__ import annotations

from iop_edge.runtime.refresh import worker
from schemas.config import ConfigError, EdgeSection

__all__ = ["ledger_problems", "main"]


def ledger_problems(edge: EdgeSection) -> list[ConfigError]:
    from iop_edge.runtime.metering.ledger import ledger_problems as problems

    return problems(edge)


def main() -> None:
    worker.main(ledger_check=ledger_problems)


if __name__ == "__main__":
    main()
