"""The Edge's pure core: config validation, pool decisions, refresh diff and plan, snapshot.

Everything here is synchronous: rules written at the top of each module, tested without
an event loop. It starts no thread, reads no clock (a rule that needs the time is given
it), and touches neither the cyclic collector nor ctypes; the import contract in
pyproject.toml forbids `threading`, `time`, `gc`, `ctypes`, Trio and sockets here. The
one reach outside, on purpose, is reading files for validation: `config.load_config`
reads the config file, and `host.py` *reads* this machine (TLS files, `state_dir`) so that
validation applies every rule `serve` needs, and `check-config` never says OK to a
config `serve` would refuse. The runtime layer keeps the state these functions are asked
about and acts on the answers.
"""
