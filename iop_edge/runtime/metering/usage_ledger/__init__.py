"""The durable usage ledger (design §7): SQLite or PostgreSQL behind one store contract,
its journal and schema upgrades, and daily budgets reserved against it (design §15)."""
