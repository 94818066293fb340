"""Fixtures of the protocol translation tests: the SDKs, talking to a replay server."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from .replay_server import ReplayServer, replay_server


@pytest.fixture(scope="session")
def replay() -> Iterator[ReplayServer]:
    with replay_server() as server:
        yield server


@pytest.fixture(scope="session")
def anthropic_client(replay: ReplayServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=replay.url, api_key="test", max_retries=0) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(replay: ReplayServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{replay.url}/v1", api_key="test", max_retries=0) as client:
        yield client
