"""Where the code both processes share reaches past a dependency's public API: one module
per dependency.

Each module names the private attributes it uses and why, checks once at import whether
the installed version is one known to have them (a flag), and falls back to the public API
when it is not. `tests/compat/` asserts every capability on the installed versions, and
`pyproject.toml` bounds those versions from above, so an upgrade is a deliberate act.
(A process's own reach-ins live in its own compat package: `iop_node.compat`,
`iop_edge.http.compat`.)
"""
