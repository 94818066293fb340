"""The loopback-only admin API (design §10): the app, one module per route group, and the
services and answer shapes they share."""
