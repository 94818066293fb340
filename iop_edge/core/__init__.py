"""The Edge's pure core: config validation, pool decisions, refresh diff and plan, snapshot.

Everything here is synchronous: rules written at the top of each module, tested without
an event loop. It does no I/O (no files, sockets or TLS), starts no thread, reads no clock
(a rule that needs the time is given it), and touches neither the cyclic collector nor
ctypes; the import contract in pyproject.toml forbids `os`, `pathlib`, `io`, `ssl`,
`threading`, `time`, `gc`, `ctypes`, Trio and sockets here. Reading the config file and
checking it against this machine (TLS files, `state_dir`) is the runtime's
(`runtime.refresh.config_file`, `runtime.lifecycle.host_checks`). The runtime layer keeps
the state these functions are asked about and acts on the answers.
"""
