"""The golden stream cases: chat chunks as runtimes send them, and the events expected.

Each `golden/<case>.json` holds a runtime's chat stream (`chunks`), the Responses request
it answers (`request`: its tools and echoed settings), what the Node passes to `finish`
(`finish_usage`, when the runtime reported no usage), and the events each translator
must produce (`messages`, `responses`: `[{"event": name, "data": {...}}, ...]`). Cases
named after a bug class of translating gateways say so in their `description`.

`IOP_UPDATE_GOLDEN=1` rewrites the expected events from the translators' output; the
diff is then reviewed like code. The checks that do not depend on the golden events
(`Expected`, read from the chunks alone) run either way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iop_node.protocols import MessagesStream, ResponsesStream, TokenUsage
from iop_node.reply import ParsedChunk, read_chunk

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("IOP_UPDATE_GOLDEN") == "1"
REQUEST_ID = "g1"
REPLY_MODEL = "alias-model"
NOW = 1767225600.0


def clock() -> float:
    return NOW


@dataclass(frozen=True)
class Case:
    name: str
    path: Path
    raw: dict[str, Any]

    @property
    def chunks(self) -> list[bytes]:
        return [json.dumps(chunk).encode() for chunk in self.raw["chunks"]]

    @property
    def request(self) -> bytes:
        return json.dumps(self.raw["request"]).encode()

    @property
    def finish_usage(self) -> TokenUsage | None:
        usage = self.raw.get("finish_usage")
        return TokenUsage(**usage) if usage else None

    def applies_to(self, protocol: str) -> bool:
        return bool(self.raw.get("only", protocol) == protocol)

    def expected_events(self, protocol: str, produced: list[dict[str, Any]]) -> list[Any]:
        """The golden events (first written from `produced` under `IOP_UPDATE_GOLDEN`)."""
        if UPDATE or protocol not in self.raw:
            self.raw[protocol] = produced
            self.path.write_text(json.dumps(self.raw, indent=1, ensure_ascii=False) + "\n")
        expected: list[Any] = self.raw[protocol]
        return expected


def cases(protocol: str) -> list[Case]:
    found = [
        Case(path.stem, path, json.loads(path.read_text()))
        for path in sorted(GOLDEN.glob("*.json"))
    ]
    return [case for case in found if case.applies_to(protocol)]


def _reading(chunk: bytes, relayed: bool) -> ParsedChunk | None:
    """The relay's reading of `chunk` when the stream came through one (`relayed`)."""
    return read_chunk(chunk) if relayed else None


def messages_sse(case: Case, *, relayed: bool = False) -> bytes:
    """The case translated; `relayed`: each chunk handed over with an HTTP relay's reading."""
    stream = MessagesStream(REPLY_MODEL, REQUEST_ID)
    out = b"".join(stream.feed(chunk, _reading(chunk, relayed)) for chunk in case.chunks)
    return out + stream.finish(case.finish_usage)


def responses_sse(case: Case, *, relayed: bool = False) -> bytes:
    """The case translated; `relayed`: each chunk handed over with an HTTP relay's reading."""
    stream = ResponsesStream(REPLY_MODEL, REQUEST_ID, case.request, clock=clock)
    out = b"".join(stream.feed(chunk, _reading(chunk, relayed)) for chunk in case.chunks)
    return out + stream.finish(case.finish_usage)


def parse_sse(data: bytes) -> list[dict[str, Any]]:
    """Named events, strictly: each has one `event:` line and one `data:` line, and the
    name is the payload's `type`, as both protocols require."""
    assert data.endswith(b"\n\n"), data[-80:]
    events = []
    for block in data[:-2].split(b"\n\n"):
        lines = block.split(b"\n")
        assert len(lines) == 2, block
        assert lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), block
        name = lines[0][len(b"event: ") :].decode()
        payload = json.loads(lines[1][len(b"data: ") :])
        assert payload["type"] == name, block
        events.append({"event": name, "data": payload})
    return events


@dataclass
class Call:
    name: str = ""
    arguments: str = ""
    fragments: int = 0  # non-empty argument fragments the runtime sent


@dataclass
class Expected:
    """What a faithful translation carries, read from the chat chunks alone."""

    text: str = ""
    thinking: str = ""
    calls: list[Call] = field(default_factory=list)
    usage: TokenUsage | None = None
    finish_reason: str | None = None

    @classmethod
    def of(cls, case: Case) -> Expected:
        expected = cls()
        by_key: dict[object, Call] = {}
        for chunk in case.raw["chunks"]:
            if chunk.get("usage"):
                usage = chunk["usage"]
                expected.usage = TokenUsage(
                    prompt_tokens=usage["prompt_tokens"],
                    completion_tokens=usage["completion_tokens"],
                    cached_tokens=(usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    ),
                    reasoning_tokens=(usage.get("completion_tokens_details") or {}).get(
                        "reasoning_tokens", 0
                    ),
                )
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                expected.thinking += delta.get("reasoning_content") or delta.get("reasoning") or ""
                expected.text += (delta.get("content") or "") + (delta.get("refusal") or "")
                for fragment in delta.get("tool_calls") or []:
                    key = fragment.get("index", fragment.get("id"))
                    call = by_key.get(key)
                    if call is None:
                        call = by_key[key] = Call()
                        expected.calls.append(call)
                    function = fragment.get("function") or {}
                    call.name = call.name or function.get("name") or ""
                    if function.get("arguments"):
                        call.arguments += function["arguments"]
                        call.fragments += 1
                if choice.get("finish_reason"):
                    expected.finish_reason = choice["finish_reason"]
        if expected.usage is None:
            expected.usage = case.finish_usage or TokenUsage()
        return expected
