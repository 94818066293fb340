"""The Edge's live parts: scheduler, dispatch and runs, node hub, refresh coordinator,
metering (metrics and the usage ledger).

These own Trio tasks and mutable state, and know nothing of HTTP: they report outcomes
in their own terms and the `http` layer maps them to statuses and bodies.
"""
