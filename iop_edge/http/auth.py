"""Who is calling: the caller's token against the principal list.

A caller presents its token as `Authorization: Bearer <token>` (OpenAI's clients) or as
`x-api-key: <token>` (Anthropic's clients, design §14); both are the same principal
tokens. With no `openai.principal_tokens` configured the API is open and every caller is
`ANONYMOUS`, except a web page that may not drive it (`browser_guard`, 403); otherwise a
request without a known token is refused with 401 (`invalid_api_key`, in the caller's
protocol's error shape) before anything else about it is looked at. When both headers
are sent, `Authorization` is the one checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from iop_edge.core.configuration.tokens import hash_token
from iop_edge.http.browser_guard import browser_refusal
from iop_edge.http.errors import ApiError
from schemas.config import PrincipalToken

#: Who a request is when the Edge has no principal tokens configured (open API).
ANONYMOUS = PrincipalToken(
    token_ref="anonymous", token_hash_sha256="0" * 64, principal_ref="anonymous"
)


def authenticate(
    principals: Mapping[str, PrincipalToken],
    authorization: str,
    api_key: str = "",
    *,
    host: str | None,
    origin: str | None,
    listen: str,
) -> PrincipalToken:
    """The principal behind an `Authorization` header value, or else an `x-api-key` one
    (`""` when absent).

    `principals` maps token hashes to principals (the snapshot's index). `host`, `origin`
    (the headers, None when absent) and `listen` (the configured `openai.listen`) are
    what `browser_guard` judges when the API is open."""
    if not principals:
        refused = browser_refusal(host=host, origin=origin, listen=listen)
        if refused is not None:
            raise refused
        return ANONYMOUS
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "Missing bearer token in the Authorization header",
                type="authentication_error",
                code="invalid_api_key",
            )
    elif api_key.strip():
        token = api_key
    else:
        raise ApiError(
            401,
            "Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            type="authentication_error",
            code="invalid_api_key",
        )
    principal = principals.get(hash_token(token))
    if principal is None:
        raise ApiError(
            401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key"
        )
    return principal


class _Headers(Protocol):
    """Request headers found by lowercase name: Quart's, or a dict of ASGI's."""

    def get(self, name: str, /) -> str | None: ...


def authenticate_headers(
    principals: Mapping[str, PrincipalToken], headers: _Headers, *, listen: str
) -> PrincipalToken:
    """`authenticate` of a request's headers; `listen`: the configured `openai.listen`."""
    return authenticate(
        principals,
        headers.get("authorization") or "",
        headers.get("x-api-key") or "",
        host=headers.get("host"),
        origin=headers.get("origin"),
        listen=listen,
    )
