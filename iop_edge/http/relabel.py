"""The caller's model alias in every response and chunk (SPEC §3: callers see their alias).

The Edge rewrites `model` in what a Node sends back, and hides the usage chunk it asked
the upstream for on the caller's behalf when the caller did not ask for it (SPEC §7).
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["BadPayload", "relabel"]

_json_encode: Final = msgspec.json.Encoder().encode
_json_decode: Final = msgspec.json.Decoder().decode
_decode_top_level: Final = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


class BadPayload(Exception):
    """A Node sent a chunk or response that is not JSON."""


def relabel(data: bytes, alias: str, *, strip_usage: bool) -> bytes | None:
    """Rewrite an OpenAI JSON chunk/response so `model` is the caller's alias.

    Only the top level is parsed: every other value is kept as raw JSON and written back
    byte for byte, so provider fields pass through untouched and a large response (an
    embedding batch) costs a scan, not a full decode and re-encode. Returns None for a
    usage-only stream chunk the caller did not ask for; raises `BadPayload` when `data`
    is not a JSON object (or nests deeper than the decoder can follow).
    """
    try:
        fields = _decode_top_level(data)
        if strip_usage:
            usage = fields.get("usage")
            if usage is not None and bytes(usage) != b"null":
                choices = fields.get("choices")
                if choices is None or not _json_decode(choices):
                    return None
                del fields["usage"]
    except msgspec.DecodeError as exc:
        raise BadPayload(f"not a JSON object ({exc})") from None
    except RecursionError:  # skipping a value nested deeper than the decoder's stack
        raise BadPayload("nested too deeply") from None
    if "model" in fields:
        fields["model"] = msgspec.Raw(_json_encode(alias))
    return _json_encode(fields)
