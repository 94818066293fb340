"""The Edge's pure core: config validation, pool decisions, refresh diff and plan, snapshot.

Everything here is synchronous and does no I/O (no Trio, no sockets, no clock of its
own): rules written at the top of each module, tested without an event loop. The
runtime layer keeps the state these functions are asked about and acts on the answers.
"""
