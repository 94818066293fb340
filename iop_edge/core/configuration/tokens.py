"""Bearer tokens are stored and compared as sha256 hex digests, never as themselves (design §2.3).

One helper serves both kinds of token the Edge checks: a Node's token in `hello` against
`nodes[].token_hash_sha256`, and a caller's `Authorization: Bearer` token against
`openai.principal_tokens[].token_hash_sha256`. `iop-edge hash-token` prints the same
digest, so what an operator pastes into the config is exactly what is compared here.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

__all__ = ["DEMO_NODE_TOKEN", "DEMO_NODE_TOKEN_SHA256", "hash_token", "tokens_match"]


def hash_token(token: str) -> str:
    """The sha256 hex digest of `token`, with surrounding whitespace stripped.

    Stripping makes a token read from a file, an env var or stdin (usually with a trailing
    newline) hash the same as the token typed on the command line.
    """
    return hashlib.sha256(token.strip().encode("utf-8")).hexdigest()


def tokens_match(token: str, expected_hash: str) -> bool:
    """Whether `token` hashes to `expected_hash`, compared in constant time.

    The comparison is on the hex digests with `hmac.compare_digest`, so the time taken does
    not reveal how much of a guessed hash was right. An empty (or all-whitespace) token
    never matches: "no token" must not authenticate even if someone configured the hash of
    the empty string.
    """
    if not token.strip():
        return False
    return hmac.compare_digest(hash_token(token).encode("ascii"), expected_hash.encode("utf-8"))


#: The demo's node token. PUBLIC: it is printed in the README and its hash is in the demo
#: config (`iop_edge/examples/demo.yaml`), so `iop-edge demo` runs that file as written and
#: an edited copy refreshes without a (false) token change. Config validation refuses its
#: hash unless `edge.listen` is a loopback address: no other machine can present it.
DEMO_NODE_TOKEN: Final = "iop-demo-node-token"
DEMO_NODE_TOKEN_SHA256: Final = hash_token(DEMO_NODE_TOKEN)
