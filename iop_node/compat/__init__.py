"""Where the Node reaches past a dependency's public API: one module per dependency.

Each module names the private attributes it uses and why, and fails with an error naming
the installed versions when they are gone, instead of an `AttributeError` deep in a run.
`tests/compat/` asserts every capability on the installed versions, and `pyproject.toml`
bounds those versions from above, so an upgrade is a deliberate act.
"""
