"""The Edge's pure core: config validation, pool decisions, refresh diff and plan, snapshot.

Everything here is synchronous and does no I/O (no Trio, no sockets, no clock of its
own): rules written at the top of each module, tested without an event loop. One
exception, on purpose: `host.py` *reads* this machine (TLS files, `state_dir`) so that
validation applies every rule `serve` needs, and `check-config` never says OK to a config
`serve` would refuse. The
runtime layer keeps the state these functions are asked about and acts on the answers.
"""
