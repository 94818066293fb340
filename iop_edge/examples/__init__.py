"""Files the package ships for operators to copy: `iop-edge example NAME` prints one.

They are package data, read through `importlib.resources`, so an installed package
(a wheel, `pipx install`) has them without the repository, and there is one copy of each:
`iop-edge demo` runs `demo.yaml` from here, and the tests check every file here as the
commands that use it would.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

#: Each file, with what it is for: the order `iop-edge example` lists them in.
EXAMPLES: Final = {
    "edge.yaml": "an Edge config with every field, commented",
    "demo.yaml": "the config `iop-edge demo` runs (copy it to edit the demo)",
    "iop-edge.service": "a systemd unit for the Edge",
}


def read_example(name: str) -> str:
    """The text of one of `EXAMPLES`; `KeyError` for any other name."""
    if name not in EXAMPLES:
        raise KeyError(name)
    return (resources.files(__name__) / name).read_text(encoding="utf-8")
