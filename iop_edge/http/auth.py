"""Who is calling: the caller's `Authorization: Bearer` token against the principal list.

With no `openai.principal_tokens` configured the API is open and every caller is
`ANONYMOUS`; otherwise a request without a known token is refused with 401, in OpenAI's
error shape (`invalid_api_key`), before anything else about it is looked at.
"""

from __future__ import annotations

from collections.abc import Mapping

from iop_edge.core.tokens import hash_token
from iop_edge.http.errors import ApiError
from schemas.config import PrincipalToken

#: Who a request is when the Edge has no principal tokens configured (open API).
ANONYMOUS = PrincipalToken(
    token_ref="anonymous", token_hash_sha256="0" * 64, principal_ref="anonymous"
)


def authenticate(principals: Mapping[str, PrincipalToken], authorization: str) -> PrincipalToken:
    """The principal behind an `Authorization` header value (`""` when absent).

    `principals` maps token hashes to principals (the snapshot's index)."""
    if not principals:
        return ANONYMOUS
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "Missing bearer token in the Authorization header",
            type="authentication_error",
            code="invalid_api_key",
        )
    principal = principals.get(hash_token(token))
    if principal is None:
        raise ApiError(
            401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key"
        )
    return principal
