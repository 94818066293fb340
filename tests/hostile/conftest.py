from tests.e2e.conftest import ledger_url, postgres_server, stack_one

__all__ = ["ledger_url", "postgres_server", "stack_one"]
