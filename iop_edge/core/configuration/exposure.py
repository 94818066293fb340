"""What a config exposes that it may not mean to: warnings, not errors (the config is
valid, and a trial on a private network is a fair use of it). `check-config` prints them
and `serve` logs them at start. Pure: the config in, sentences out.

Rules:
1. A caller API that other machines can reach (`openai.listen` not a loopback address)
   with no `openai.principal_tokens` is open to anyone who reaches the port: every
   request runs as the principal `anonymous`, on every model. The warning names both
   settings and the two ways to close it.
2. A loopback caller API, or one with tokens, is not warned about: only this machine
   reaches the first, and the second answers 401 to a caller without a token.
"""

from __future__ import annotations

from iop_edge.core.configuration.listen import parse_listen_address
from schemas.config import EdgeConfig

__all__ = ["exposure_warnings"]


def exposure_warnings(config: EdgeConfig) -> list[str]:
    """Each thing `config` opens to other machines unguarded (the module's rules)."""
    listen = config.openai.listen
    try:
        loopback = parse_listen_address(listen).is_loopback
    except ValueError:  # validation reports a malformed address on its own
        return []
    if loopback or config.openai.principal_tokens:
        return []
    return [
        f"openai.listen: {listen} is not a loopback address and openai.principal_tokens "
        "is empty: anyone who reaches this port can call every model, unauthenticated (as "
        "the principal 'anonymous'). Add openai.principal_tokens (docs/configuration.md, "
        "Tokens), or listen on 127.0.0.1"
    ]
