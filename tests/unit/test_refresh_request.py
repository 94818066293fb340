"""A `POST /refresh` body read as a request (`runtime.refresh.refresh_request`): the same
request and the same errors as one decode into `RefreshRequest` gives, the candidate
unescaped a piece a step."""

from __future__ import annotations

import msgspec
import pytest

from iop_edge.runtime.refresh import json_pieces, refresh_request
from iop_edge.runtime.refresh.refresh_request import decode_request
from schemas.refresh import RefreshRequest


def test_the_first_reading_has_the_requests_fields() -> None:
    def shape(struct: type[msgspec.Struct]) -> list[tuple[str, object]]:
        return [(f.encode_name, f.default) for f in msgspec.structs.fields(struct)]

    body = shape(refresh_request._RequestBody)
    assert [name for name, _ in body] == [name for name, _ in shape(RefreshRequest)]
    assert refresh_request._RequestBody.__struct_config__.forbid_unknown_fields


@pytest.mark.parametrize(
    "body",
    [
        b'{"mode":"apply","config_yaml":"edge:\\n  id: e\\n","if_revision":3}',
        b'{"mode":"dry_run","config_yaml":null,"allow_restart_required":true}',
        b'{"mode":"apply"}',
    ],
)
async def test_a_body_reads_as_one_decode_reads_it(body: bytes) -> None:
    assert await decode_request([body[:10], body[10:]]) == msgspec.json.decode(
        body, type=RefreshRequest
    )


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"", "Object missing required field `mode`"),
        (b'{"mode":"apply","config_yaml":12}', "Expected `str | null`, got `int` - at `$.c"),
        (b'{"mode":"apply","config_yaml":[]}', "Expected `str | null`, got `array` - at `$.c"),
        (b'{"mode":"apply","allow_restart":true}', "Object contains unknown field `allow_restart`"),
        (b'{"mode":"later"}', "Invalid enum value 'later' - at `$.mode`"),
    ],
)
async def test_a_bad_body_is_refused_naming_what_is_wrong(body: bytes, error: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=None) as raised:
        await decode_request([body])
    assert str(raised.value).startswith(error)


async def test_a_long_candidate_is_unescaped_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_pieces, "STEP_BYTES", 256)
    text = "".join(f'  - id: node-{i}\n    token: "é\\\\"\n' for i in range(200))
    body = msgspec.json.encode({"mode": "apply", "config_yaml": text})
    assert (await decode_request([body])).config_yaml == text
