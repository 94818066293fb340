"""Provider adapters: one module per kind of upstream runtime."""
