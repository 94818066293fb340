"""Where the Edge reaches past a dependency's public API: one module per dependency.

Each module names the private attributes it uses, checks once at import whether the
installed version has them (a `*_SUPPORTED` flag), and falls back to the public API when
it does not. `tests/compat/` asserts every capability on the installed versions, and
`pyproject.toml` bounds those versions from above, so an upgrade is a deliberate act.
"""
