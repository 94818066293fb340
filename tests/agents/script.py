"""The scripted tool-use loop an agent CLI runs through IOP, in each caller protocol.

Pure (no I/O): `read_turn` reads what the script needs from one inference request in
chat completions, Anthropic Messages or OpenAI Responses form; `decide` picks the reply;
`render` writes that reply as the protocol's JSON body or its stream of SSE events.
`scripted_upstream.py` serves these over HTTP.

The rules, in the order `decide` applies them:

1. A request carrying a tool result is the second turn: the reply is the final text,
   `DONE: <the line of the tool's output that holds the marker>`. The marker is printed
   by the shell (`printf` assembles it), so it appears in no request before the tool
   has run: an agent can only show it after the loop went round for real.
2. A request whose last user message holds the probe prompt and that offers a shell tool
   (Claude Code's `Bash`, Codex's `exec_command`, or an older shell tool) is the first
   turn: the reply is one call of that tool running `SHELL_COMMAND`.
3. Anything else (a title, a summary, a request with no tools) gets a short text, so
   side requests an agent makes do not derail the loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

Protocol = Literal["chat", "messages", "responses"]

#: What the shell prints; it appears in no request until the tool has run.
MARKER: Final = "iop-tool-ok"
#: The command the first turn asks the agent to run (its text does not contain MARKER).
SHELL_COMMAND: Final = "printf 'iop-%s-ok\\n' tool"
#: The prompt the tests give the agents; `decide` recognises the first turn by it.
PROMPT: Final = "Run the IOP probe: run the shell command I give you and report its output."
#: The final text starts with this, then quotes the marker line the tool printed.
DONE: Final = "DONE:"
#: The short answer to side requests (rule 3).
SIDE_ANSWER: Final = "IOP probe"


def _shell_arguments() -> dict[str, dict[str, Any]]:
    """Arguments of each shell tool the agents offer, by tool name."""
    return {
        "Bash": {"command": SHELL_COMMAND, "description": "Print the IOP probe marker"},
        "exec_command": {"cmd": SHELL_COMMAND},
        "shell_command": {"command": SHELL_COMMAND},
        "shell": {"command": ["bash", "-lc", SHELL_COMMAND]},
    }


# --- what one request says ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolResult:
    call_id: str
    text: str


@dataclass(frozen=True, slots=True)
class Turn:
    """What the script reads from one inference request, whatever its protocol."""

    protocol: Protocol
    model: str
    stream: bool
    tools: tuple[str, ...]
    last_user_text: str
    tool_results: tuple[ToolResult, ...]
    include_usage: bool = False
    """Chat completions only: `stream_options.include_usage`."""


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or a list of text-like parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = [
        part.get("text") or part.get("content") or ""
        for part in content
        if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text")
    ]
    return "\n".join(text for text in texts if isinstance(text, str))


def _read_chat(body: dict[str, Any]) -> tuple[tuple[str, ...], str, tuple[ToolResult, ...]]:
    tools = tuple(
        tool["function"]["name"]
        for tool in body.get("tools") or []
        if tool.get("type") == "function" and isinstance(tool.get("function"), dict)
    )
    user_text = ""
    results: list[ToolResult] = []
    for message in body.get("messages") or []:
        if message.get("role") == "user":
            user_text = _text_of(message.get("content"))
        elif message.get("role") == "tool":
            results.append(
                ToolResult(str(message.get("tool_call_id")), _text_of(message.get("content")))
            )
    return tools, user_text, tuple(results)


def _read_messages(body: dict[str, Any]) -> tuple[tuple[str, ...], str, tuple[ToolResult, ...]]:
    tools = tuple(str(tool.get("name")) for tool in body.get("tools") or [])
    user_text = ""
    results: list[ToolResult] = []
    for message in body.get("messages") or []:
        if message.get("role") != "user":
            continue  # assistant turns, and the mid-conversation system notes Claude Code adds
        content = message.get("content")
        blocks = content if isinstance(content, list) else []
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                results.append(
                    ToolResult(str(block.get("tool_use_id")), _text_of(block.get("content")))
                )
        text = _text_of(content)
        if text:
            user_text = text
    return tools, user_text, tuple(results)


def _read_responses(body: dict[str, Any]) -> tuple[tuple[str, ...], str, tuple[ToolResult, ...]]:
    tools: list[str] = []
    for tool in body.get("tools") or []:
        if tool.get("type") == "function":
            tools.append(str(tool.get("name")))
        elif tool.get("type") == "namespace":  # a group of functions (Codex's sub-agents)
            tools.extend(str(inner.get("name")) for inner in tool.get("tools") or [])
    items = body.get("input")
    if isinstance(items, str):
        return tuple(tools), items, ()
    user_text = ""
    results: list[ToolResult] = []
    for item in items or []:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "user":
            user_text = _text_of(item.get("content"))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output)
            results.append(ToolResult(str(item.get("call_id")), text))
    return tuple(tools), user_text, tuple(results)


_READERS: Final[
    dict[Protocol, Callable[[dict[str, Any]], tuple[tuple[str, ...], str, tuple[ToolResult, ...]]]]
] = {"chat": _read_chat, "messages": _read_messages, "responses": _read_responses}


def read_turn(protocol: Protocol, body: dict[str, Any]) -> Turn:
    tools, user_text, results = _READERS[protocol](body)
    options = body.get("stream_options")
    return Turn(
        protocol=protocol,
        model=str(body.get("model", "")),
        stream=bool(body.get("stream")),
        tools=tools,
        last_user_text=user_text,
        tool_results=results,
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


# --- the script ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    call_id: str
    name: str
    arguments: str
    """JSON text, as every protocol carries a function's arguments on the wire."""


Reply = Text | Call


def decide(turn: Turn, *, call_id: str) -> Reply:
    """The scripted reply to `turn` (rules 1-3 of the module docstring); `call_id` names
    the tool call if this turn makes one."""
    if turn.tool_results:
        output = turn.tool_results[-1].text
        lines = [line.strip() for line in output.splitlines() if MARKER in line]
        if lines:
            return Text(f"{DONE} {lines[-1]}")
        return Text(f"The tool ran, but its output lacks the marker: {output[:300]!r}")
    if PROMPT not in turn.last_user_text or not turn.tools:
        return Text(SIDE_ANSWER)
    shells = _shell_arguments()
    for name in turn.tools:
        if name in shells:
            return Call(call_id, name, json.dumps(shells[name]))
    return Text(f"No shell tool offered; the tools were: {', '.join(turn.tools)}")


# --- replies on the wire ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    output_tokens: int


def _halves(text: str) -> list[str]:
    """`text` in two pieces, so every stream carries a delta that is not the whole."""
    middle = max(1, len(text) // 2)
    return [piece for piece in (text[:middle], text[middle:]) if piece]


def _output_tokens(reply: Reply) -> int:
    return len((reply.text if isinstance(reply, Text) else reply.arguments).split()) + 1


def usage_for(body_size: int, reply: Reply) -> Usage:
    """A plausible token count: about four bytes of request per prompt token."""
    return Usage(input_tokens=max(1, body_size // 4), output_tokens=_output_tokens(reply))


# chat completions


def _chat_message(reply: Reply) -> dict[str, Any]:
    if isinstance(reply, Text):
        return {"role": "assistant", "content": reply.text}
    function = {"name": reply.name, "arguments": reply.arguments}
    call = {"id": reply.call_id, "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _chat_usage(usage: Usage) -> dict[str, int]:
    total = usage.input_tokens + usage.output_tokens
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": total,
    }


def _chat_finish(reply: Reply) -> str:
    return "stop" if isinstance(reply, Text) else "tool_calls"


def chat_body(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> dict[str, Any]:
    choice = {"index": 0, "message": _chat_message(reply), "finish_reason": _chat_finish(reply)}
    return {
        "id": reply_id,
        "object": "chat.completion",
        "created": 0,
        "model": turn.model,
        "choices": [choice],
        "usage": _chat_usage(usage),
    }


def chat_events(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> Iterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        event = {
            "id": reply_id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": turn.model,
            "choices": [choice],
        }
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if isinstance(reply, Text):
        for piece in _halves(reply.text):
            yield chunk({"content": piece})
    else:
        opening = {
            "index": 0,
            "id": reply.call_id,
            "type": "function",
            "function": {"name": reply.name, "arguments": ""},
        }
        yield chunk({"tool_calls": [opening]})
        for piece in _halves(reply.arguments):
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    yield chunk({}, _chat_finish(reply))
    if turn.include_usage:
        last = {
            "id": reply_id,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": turn.model,
            "choices": [],
            "usage": _chat_usage(usage),
        }
        yield b"data: " + json.dumps(last).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


# Anthropic Messages


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps(payload).encode() + b"\n\n"


def _messages_usage(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _messages_block(reply: Reply) -> dict[str, Any]:
    if isinstance(reply, Text):
        return {"type": "text", "text": reply.text}
    return {
        "type": "tool_use",
        "id": reply.call_id,
        "name": reply.name,
        "input": json.loads(reply.arguments),
    }


def _messages_stop(reply: Reply) -> str:
    return "end_turn" if isinstance(reply, Text) else "tool_use"


def messages_body(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> dict[str, Any]:
    return {
        "id": reply_id,
        "type": "message",
        "role": "assistant",
        "model": turn.model,
        "content": [_messages_block(reply)],
        "stop_reason": _messages_stop(reply),
        "stop_sequence": None,
        "usage": _messages_usage(usage),
    }


def messages_events(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> Iterator[bytes]:
    start = messages_body(turn, reply, Usage(usage.input_tokens, 1), reply_id)
    start.update(content=[], stop_reason=None)
    yield _sse("message_start", {"type": "message_start", "message": start})
    yield _sse("ping", {"type": "ping"})
    if isinstance(reply, Text):
        block: dict[str, Any] = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": piece} for piece in _halves(reply.text)]
    else:
        block = {"type": "tool_use", "id": reply.call_id, "name": reply.name, "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": piece}
            for piece in _halves(reply.arguments)
        ]
    yield _sse(
        "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    )
    for delta in deltas:
        yield _sse(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": _messages_stop(reply), "stop_sequence": None},
            "usage": {"output_tokens": usage.output_tokens},
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})


# OpenAI Responses


def _responses_item(reply: Reply, reply_id: str, *, done: bool) -> dict[str, Any]:
    status = "completed" if done else "in_progress"
    if isinstance(reply, Text):
        content = [{"type": "output_text", "text": reply.text, "annotations": []}]
        return {
            "type": "message",
            "id": f"msg_{reply_id}",
            "status": status,
            "role": "assistant",
            "content": content if done else [],
        }
    return {
        "type": "function_call",
        "id": f"fc_{reply_id}",
        "call_id": reply.call_id,
        "name": reply.name,
        "arguments": reply.arguments if done else "",
        "status": status,
    }


def responses_body(
    turn: Turn, reply: Reply | None, usage: Usage | None, reply_id: str
) -> dict[str, Any]:
    """The response object; `reply` None is the one `response.created` announces."""
    done = reply is not None and usage is not None
    return {
        "id": f"resp_{reply_id}",
        "object": "response",
        "created_at": 0,
        "status": "completed" if done else "in_progress",
        "model": turn.model,
        "output": [_responses_item(reply, reply_id, done=True)] if reply is not None else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": None,
        "top_p": None,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.input_tokens + usage.output_tokens,
        },
    }


def responses_events(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> Iterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return _sse(kind, {"type": kind, "sequence_number": sequence - 1, **fields})

    pending = responses_body(turn, None, None, reply_id)
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    item_id = _responses_item(reply, reply_id, done=False)["id"]
    yield event(
        "response.output_item.added",
        output_index=0,
        item=_responses_item(reply, reply_id, done=False),
    )
    if isinstance(reply, Text):
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **where, part=part)
        for piece in _halves(reply.text):
            yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
        yield event("response.output_text.done", **where, text=reply.text, logprobs=[])
        yield event("response.content_part.done", **where, part={**part, "text": reply.text})
    else:
        for piece in _halves(reply.arguments):
            yield event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=0,
                delta=piece,
            )
        yield event(
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=0,
            arguments=reply.arguments,
        )
    yield event(
        "response.output_item.done",
        output_index=0,
        item=_responses_item(reply, reply_id, done=True),
    )
    yield event("response.completed", response=responses_body(turn, reply, usage, reply_id))


_BODIES: Final[dict[Protocol, Callable[[Turn, Reply, Usage, str], dict[str, Any]]]] = {
    "chat": chat_body,
    "messages": messages_body,
    "responses": responses_body,
}
_EVENTS: Final[dict[Protocol, Callable[[Turn, Reply, Usage, str], Iterator[bytes]]]] = {
    "chat": chat_events,
    "messages": messages_events,
    "responses": responses_events,
}


def render_body(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> bytes:
    """The non-stream reply: one JSON body in the turn's protocol."""
    return json.dumps(_BODIES[turn.protocol](turn, reply, usage, reply_id)).encode()


def render_events(turn: Turn, reply: Reply, usage: Usage, reply_id: str) -> list[bytes]:
    """The stream reply: each SSE event of the turn's protocol, framed, in order."""
    return list(_EVENTS[turn.protocol](turn, reply, usage, reply_id))
