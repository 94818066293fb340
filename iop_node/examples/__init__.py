"""Files the package ships for Node operators to copy: `iop-node example NAME` prints one.

Package data read through `importlib.resources`, so an installed package (a wheel,
`pipx install`) has them without the repository; the tests check each as the command
that uses it would.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

#: Each file, with what it is for: the order `iop-node example` lists them in.
EXAMPLES: Final = {
    "node.yaml": "the optional `iop-node run --config` file, commented",
    "iop-node.service": "a systemd unit for a Node, its token a systemd credential",
}


def read_example(name: str) -> str:
    """The text of one of `EXAMPLES`; `KeyError` for any other name."""
    if name not in EXAMPLES:
        raise KeyError(name)
    return (resources.files(__name__) / name).read_text(encoding="utf-8")
