"""What the caller sees, shaped on the Node (design §3, per-token work).

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
5. A stream chunk is read once (`read_chunk`) for everything the Node does with it: the
   relay's checks (usage, finish, an in-band error), the caller's shape (Rules 1-3) and
   the output estimate (`schemas.tokens`). An adapter that read it already hands the
   reading over with the chunk, so nothing parses a chunk twice. Likewise a whole
   response's usage is read once: by the adapter when it reports it, else here.
6. Cached prompt tokens (design §7): `usage.prompt_tokens_details.cached_tokens` when the
   upstream reports it, else llama.cpp's `timings.cache_n` (`cache_timings`), capped at
   the prompt. Nothing else is read for it.
"""

from __future__ import annotations

from typing import Final

import msgspec

from iop_node.cache_timings import timings_cached
from schemas import wire
from schemas.tokens import ChoiceView, read_choices

__all__ = ["NotAnObject", "ParsedChunk", "ReplyShaper", "UsageView", "read_chunk"]

_decode_top_level: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_encode: Final = msgspec.json.Encoder().encode


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


_decode_details: Final = msgspec.json.Decoder(_PromptDetails | None).decode


class UsageView(msgspec.Struct):
    """A `usage` object as an upstream reports it (numbers unchecked)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: msgspec.Raw = msgspec.Raw()
    """Read only for its `cached_tokens`, leniently: details that do not read cost the
    count of cached tokens, never the usage."""

    @property
    def cached_tokens(self) -> int | None:
        """The cached prompt tokens it reports; None when it does not say."""
        raw = self.prompt_tokens_details
        if not raw:
            return None
        try:
            details = _decode_details(raw)
        except (msgspec.DecodeError, RecursionError):
            return None
        return None if details is None else details.cached_tokens

    def to_usage(self, cache_n: int | None = None) -> wire.Usage:
        """As reported: missing counts are 0, a missing total is the sum; the cached
        tokens from `prompt_tokens_details`, else llama.cpp's `timings.cache_n`
        (`cache_n`, Rule 6), at most the prompt."""
        prompt = self.prompt_tokens or 0
        completion = self.completion_tokens or 0
        total = self.total_tokens if self.total_tokens is not None else prompt + completion
        cached = self.cached_tokens
        if cached is None:
            cached = cache_n
        return wire.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=total,
            cached_tokens=min(max(cached or 0, 0), max(prompt, 0)),
        )


_decode_usage: Final = msgspec.json.Decoder(UsageView | None).decode
_decode_list: Final = msgspec.json.Decoder(list[msgspec.Raw] | None).decode
_decode_text: Final = msgspec.json.Decoder(str | None).decode


class NotAnObject(ValueError):
    """A chunk or response that is not a JSON object (Rule 4); `malformed` when it is not
    JSON at all."""

    def __init__(self, message: str, *, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


class ParsedChunk:
    """One stream chunk, read once (Rule 5). `fields` holds its top-level values as raw
    JSON; the rest is what the relay, the shaper and the estimate need of them."""

    __slots__ = ("choices", "data", "fields", "usage")

    def __init__(self, data: bytes, fields: dict[str, msgspec.Raw]) -> None:
        self.data = data
        self.fields = fields
        usage = fields.get("usage")
        self.usage: UsageView | None = None if usage is None else _usage_view(usage)
        """The chunk's usage; None when it has none (or JSON null, or not an object)."""
        self.choices: list[ChoiceView] | NotChoices | None = _choices_of(fields.get("choices"))

    @property
    def finished(self) -> bool:
        """Some choice has a `finish_reason`."""
        choices = self.choices
        return isinstance(choices, list) and any(
            isinstance(choice.finish_reason, str) and choice.finish_reason for choice in choices
        )

    @property
    def is_error(self) -> bool:
        """The upstream reports an error in band: an `error` member that is not null, or
        `"object": "error"` (older vLLM)."""
        error = self.fields.get("error")
        if error is not None and bytes(error) != b"null":
            return True
        kind = self.fields.get("object")
        if kind is None:
            return False
        try:
            return _decode_text(kind) == "error"
        except msgspec.DecodeError:
            return False

    def output_chars(self) -> int | None:
        """`schemas.tokens.output_chars` of the chunk (None: not shaped like output)."""
        choices = self.choices
        if isinstance(choices, NotChoices):
            return None
        return sum(choice.chars() for choice in choices or ())


class NotChoices:
    """`choices` that do not read as OpenAI choices (counted, never parsed again)."""

    __slots__ = ()


_NOT_CHOICES: Final = NotChoices()


def _choices_of(raw: msgspec.Raw | None) -> list[ChoiceView] | NotChoices | None:
    if raw is None:
        return None
    try:
        return read_choices(raw)
    except (msgspec.DecodeError, RecursionError):
        return _NOT_CHOICES


def _usage_view(raw: msgspec.Raw) -> UsageView | None:
    try:
        return _decode_usage(raw)
    except (msgspec.DecodeError, RecursionError):
        return None  # not a usage object: relayed as it is, counted as nothing


def read_chunk(data: bytes) -> ParsedChunk:
    """Read one stream chunk (Rule 5); `NotAnObject` when it is not a JSON object."""
    return ParsedChunk(data, _fields(data))


def _fields(data: bytes) -> dict[str, msgspec.Raw]:
    try:
        fields = _decode_top_level(data)
    except msgspec.ValidationError as exc:
        raise NotAnObject(f"not a JSON object ({exc})") from None
    except msgspec.DecodeError as exc:
        raise NotAnObject(f"not a JSON object ({exc})", malformed=True) from None
    except RecursionError:  # skipping a value nested deeper than the decoder's stack
        raise NotAnObject("nested too deeply") from None
    if not data.isascii():  # the decoder skips the raw values unchecked: JSON is UTF-8
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise NotAnObject(
                f"not JSON (invalid UTF-8 at byte {exc.start})", malformed=True
            ) from None
    return fields


class ReplyShaper:
    """Shapes one run's chunks and response for its caller (see the module docstring)."""

    __slots__ = ("_alias", "_strip_usage", "_timings_cached", "usage")

    def __init__(self, run: wire.Run) -> None:
        self._alias = _encode(run.reply_model) if run.reply_model else None
        self._strip_usage = run.strip_usage
        self._timings_cached: int | None = None
        self.usage: wire.Usage | None = None
        """The last usage the upstream reported in a chunk or response (Rule 2)."""

    def event(self, chunk: bytes | ParsedChunk) -> bytes | None:
        """One stream chunk (or its reading, Rule 5) as a server-sent event, or None when
        it is dropped. The reading's `fields` are the shaper's to change."""
        parsed = read_chunk(chunk) if isinstance(chunk, bytes) else chunk
        fields = parsed.fields
        changed = False
        timings = fields.get("timings")
        if timings is not None:
            self._timings(timings)
        if parsed.usage is not None:
            self._record(parsed.usage)
            if self._strip_usage:
                choices = parsed.choices
                if choices is None or not (
                    choices if isinstance(choices, list) else self._list(fields["choices"])
                ):
                    return None
                del fields["usage"]
                changed = True
        return b"data: " + self._encode(parsed.data, fields, changed) + b"\n\n"

    def response(self, body: bytes, *, read_usage: bool = True) -> bytes:
        """A whole (non-stream) response with the caller's alias. Its usage (Rules 2, 6)
        is read unless `read_usage` is False: the adapter read it already (Rule 5)."""
        fields = _fields(body)
        if not read_usage:
            return self._encode(body, fields, False)
        timings = fields.get("timings")
        if timings is not None:
            self._timings(timings)
        usage = fields.get("usage")
        if usage is not None:
            view = _usage_view(usage)
            if view is not None:
                self._record(view)
        return self._encode(body, fields, False)

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

    def _record(self, view: UsageView) -> None:
        """Keep the usage the upstream reported (Rule 2), negative counts as 0."""
        prompt = max(view.prompt_tokens or 0, 0)
        completion = max(view.completion_tokens or 0, 0)
        total = view.total_tokens if view.total_tokens is not None else prompt + completion
        cached = view.cached_tokens
        if cached is None:
            cached = self._timings_cached
        self.usage = wire.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=max(total, 0),
            cached_tokens=min(max(cached or 0, 0), prompt),
        )

    def _timings(self, raw: msgspec.Raw) -> None:
        """llama.cpp's `timings` (Rule 6): its `cache_n` counts for the usage already
        kept, and for one that comes after it."""
        cached = timings_cached(raw)
        if cached is None:
            return
        self._timings_cached = cached
        usage = self.usage
        if usage is not None and usage.cached_tokens == 0:
            self.usage = msgspec.structs.replace(
                usage, cached_tokens=min(max(cached, 0), usage.prompt_tokens)
            )
