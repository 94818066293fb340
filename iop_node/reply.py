"""What the caller sees, shaped on the Node (SPEC §3, revision 2: per-token work).

The Edge is the one shared part of a fleet; Nodes scale out with it. So the per-chunk
work a gateway must do is done here, once per chunk, and the Edge relays bytes:

Rules:
1. `model` in every chunk and response is the caller's alias (`run.reply_model`); every
   other field passes through byte for byte. Only the top level of a JSON object is
   parsed: values are kept as raw JSON and written back untouched, so a large response
   (an embedding batch) costs a scan, not a decode and re-encode.
2. The usage the upstream reports is kept for `run_done`. A usage-only stream chunk (no
   choices) that the caller did not ask for (`run.strip_usage`) is dropped.
3. Stream chunks leave framed as server-sent events (`data: {...}\\n\\n`): the Edge
   writes them to the caller as they are.
4. What is not a JSON object cannot be shaped: `NotAnObject` (the adapter's output is
   broken, and the run fails here rather than at the caller).
"""

from __future__ import annotations

from typing import Final

import msgspec

from schemas import wire

__all__ = ["NotAnObject", "ReplyShaper"]

_decode_top_level: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_encode: Final = msgspec.json.Encoder().encode


class _UsageView(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


_decode_usage: Final = msgspec.json.Decoder(_UsageView | None).decode
_decode_list: Final = msgspec.json.Decoder(list[msgspec.Raw] | None).decode


class NotAnObject(ValueError):
    """A chunk or response that is not a JSON object (Rule 4)."""


class ReplyShaper:
    """Shapes one run's chunks and response for its caller (see the module docstring)."""

    __slots__ = ("_alias", "_strip_usage", "usage")

    def __init__(self, run: wire.Run) -> None:
        self._alias = _encode(run.reply_model) if run.reply_model else None
        self._strip_usage = run.strip_usage
        self.usage: wire.Usage | None = None
        """The last usage the upstream reported in a chunk or response (Rule 2)."""

    def event(self, chunk: bytes) -> bytes | None:
        """One stream chunk as a server-sent event, or None when it is dropped."""
        fields = self._fields(chunk)
        usage = fields.get("usage")
        changed = False
        if usage is not None and self._record_usage(usage) and self._strip_usage:
            choices = fields.get("choices")
            if choices is None or not self._list(choices):
                return None
            del fields["usage"]
            changed = True
        return b"data: " + self._encode(chunk, fields, changed) + b"\n\n"

    def response(self, body: bytes) -> bytes:
        """A whole (non-stream) response with the caller's alias."""
        fields = self._fields(body)
        usage = fields.get("usage")
        if usage is not None:
            self._record_usage(usage)
        return self._encode(body, fields, False)

    def _fields(self, data: bytes) -> dict[str, msgspec.Raw]:
        try:
            return _decode_top_level(data)
        except msgspec.DecodeError as exc:
            raise NotAnObject(f"not a JSON object ({exc})") from None
        except RecursionError:  # skipping a value nested deeper than the decoder's stack
            raise NotAnObject("nested too deeply") from None

    def _encode(self, original: bytes, fields: dict[str, msgspec.Raw], changed: bool) -> bytes:
        """`fields` as JSON with the alias in `model`; `original` itself when unchanged."""
        if self._alias is not None and "model" in fields:
            fields["model"] = msgspec.Raw(self._alias)
        elif not changed:
            return original
        return _encode(fields)

    @staticmethod
    def _list(raw: msgspec.Raw) -> list[msgspec.Raw] | None:
        try:
            return _decode_list(raw)
        except (msgspec.DecodeError, RecursionError):
            raise NotAnObject("`choices` is not a list") from None

    def _record_usage(self, raw: msgspec.Raw) -> bool:
        """Keep the usage in `raw`; False when it is JSON null (no usage in this chunk)."""
        try:
            view = _decode_usage(raw)
        except (msgspec.DecodeError, RecursionError):
            return False  # not a usage object: relay it as it is, count nothing
        if view is None:
            return False
        prompt = max(view.prompt_tokens or 0, 0)
        completion = max(view.completion_tokens or 0, 0)
        total = view.total_tokens if view.total_tokens is not None else prompt + completion
        self.usage = wire.Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=max(total, 0)
        )
        return True
