"""The TLS contexts a process makes: what the tests that bound trust-store loads count.

Loading a trust store costs tens of milliseconds of CPU on the loop that asks for it, so
the Node makes each of its TLS contexts once per trust store (`iop_node.tls`). Its tests
count the contexts the factory it goes through makes.
"""

from __future__ import annotations

import ssl
from typing import Any

import pytest


def record_contexts(
    monkeypatch: pytest.MonkeyPatch, module: object, factory: str
) -> list[ssl.SSLContext]:
    """The contexts `module.factory` makes from now on (for the rest of the test), in
    the order it makes them; each is still returned to its caller."""
    made: list[ssl.SSLContext] = []
    create = getattr(module, factory)

    def recorded(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made.append(create(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(module, factory, recorded)
    return made
