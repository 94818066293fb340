from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import trio

from tests.e2e.postgres import PASSWORD_ENV, Postgres, create_database, start_postgres
from tests.e2e.stack import Stack, one_sim_config, start_stack
from tests.e2e.upstreams import MakeStack, upstream_stacks


@pytest.fixture
async def stack_one(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    """One Node with one sim provider serving model `m`."""
    text = one_sim_config(tmp_path)
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """A throwaway PostgreSQL server for this test session (see `tests/e2e/postgres.py`)."""
    yield from start_postgres()


@pytest.fixture
def ledger_url(
    postgres_server: Postgres, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A fresh database for one test; the `iop` role's password is in `PASSWORD_ENV`."""
    monkeypatch.setenv(PASSWORD_ENV, postgres_server.password)
    name = "t_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:50]
    return create_database(postgres_server, name)


@pytest.fixture
async def make_stack(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[MakeStack]:
    """A factory of stacks relaying to fake upstreams (`upstreams.upstream_stacks`)."""
    async with upstream_stacks(nursery, tmp_path) as make:
        yield make


#: What no caller's error may say (design §4 item 10): an address on this machine, or a
#: provider or node as IOP's own messages name them.
_TOPOLOGY = re.compile(r"127\.0\.0\.1:\d+|\blocalhost:\d+|\b(?:node|provider) '")


@pytest.fixture(autouse=True)
def caller_errors_name_no_topology(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every error body the Edge writes for a caller in these tests is checked: none
    names an address, a provider or a node (the websocket refusal of a caller port names
    where Nodes connect, for the operator who pointed one there, and is left alone)."""
    from iop_edge.http.errors import ApiError
    from iop_edge.http.server import WRONG_PORT_CODE

    said: list[str] = []

    def checked(shape: Callable[..., bytes]) -> Callable[..., bytes]:
        def body(self: ApiError, *args: object, **kwargs: object) -> bytes:
            written = shape(self, *args, **kwargs)
            if self.code != WRONG_PORT_CODE and _TOPOLOGY.search(self.message):
                said.append(self.message)
            return written

        return body

    for shape in ("body", "anthropic_body"):  # OpenAI's error shape, Anthropic's
        monkeypatch.setattr(ApiError, shape, checked(getattr(ApiError, shape)))
    yield
    assert not said, f"caller errors that name the Edge's topology: {said}"
