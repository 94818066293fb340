"""Where the Edge's HTTP layer reaches past Hypercorn's public API: `hypercorn.py` names
every internal it builds on, and `tests/compat/test_hypercorn.py` proves them on the
installed version (`pyproject.toml` bounds that version from above, so an upgrade is a
deliberate act). Nothing else in the Edge imports from Hypercorn but its public modules
(`hypercorn.config`, `hypercorn.typing`).
"""
