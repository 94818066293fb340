"""What a caller's error may say about where its request went: nothing.

The Edge's providers, Nodes and the addresses of their runtimes are the operator's
business. A caller's error that names them (`provider 'gpu1-llama' failed: 127.0.0.1:24410
unreachable`) tells a stranger the shape of the fleet and tells the caller nothing it
can act on. The operator reads them in the Edge's log, under the request id.

Rules:
1. A caller's error names no provider id, node id, host, address or port.
2. The upstream's own words stay (a caller acts on them: design §4 item 10), with
   the topology taken out: URLs, IP addresses (with their port), `host:port`, Python's
   `('host', port)`, a `node '...'` or `provider '...'` IOP's messages name, and the
   ids of the provider that served, wherever they appear.
3. A failure's error ends with the request id the caller got (`x-request-id`), the
   key under which the Edge logs the whole story.
4. No credential: an upstream that echoes the key it was sent (OpenAI's `Incorrect API
   key provided: sk-...`) would hand the operator's key to every caller of the model,
   and write it into the Edge's log. Whatever is shaped like an API key or a bearer
   token becomes `CREDENTIAL`, in the caller's text and the log line alike.
5. An upstream's error `code` and `param` are identifiers a caller branches on
   (`context_length_exceeded`, `messages[0].content`): passed on whole or not at all.
   One not shaped like an identifier (at most 64 letters, digits and `_.:[]-`), or
   holding a credential, an address or a provider id, is left out, so it reaches no
   caller, log line or metric label.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

__all__ = [
    "ADDRESS",
    "CREDENTIAL",
    "upstream_identifier",
    "with_request_id",
    "without_credentials",
    "without_topology",
]

#: What an address becomes in a caller's text.
ADDRESS: Final = "<address>"
#: What a credential becomes (Rule 4).
CREDENTIAL: Final = "<credential>"

_URL: Final = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]+")
_SOCKET_TUPLE: Final = re.compile(r"\(\s*'[^']*'\s*(?:,\s*\d+\s*)+\)")
_IPV6: Final = re.compile(r"\[[0-9A-Fa-f.%\w]*:[0-9A-Fa-f:.%\w]*\](?::\d{1,5})?")
_IPV4: Final = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b")
# A host name (with a letter in it, so `12:30` is no address) and a port.
_HOST_PORT: Final = re.compile(
    r"(?<![\w.-])(?=[A-Za-z0-9.-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*:\d{2,5}\b"
)
_NAMED: Final = re.compile(r"\b(node|provider|Node|Provider)(?: id)? '[^']*'")
#: Keys by their vendors' prefixes (OpenAI and Anthropic `sk-`, Groq `gsk_`, xAI `xai-`,
#: Hugging Face `hf_`, GitHub and GitLab tokens, Google `AIza`, AWS access key ids), a
#: bearer token, and the value after a name that says it is secret.
_KEYS: Final = re.compile(
    r"\b(?:sk|pk|rk|gsk|xai|hf|ghp|gho|ghs|github_pat|glpat)[-_][A-Za-z0-9_*-]{6,}"
    r"|\bAIza[0-9A-Za-z_-]{20,}|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
)
_BEARER: Final = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{6,}")
_SECRET_VALUE: Final = re.compile(
    r"(?i)\b((?:api[_-]?key|access[_-]?token|auth[_-]?token|secret|password|x-api-key)"
    r"[\"']?\s*[=:]\s*[\"']?)[^\s\"',;&]+"
)


def without_credentials(text: str) -> str:
    """`text` with whatever looks like a credential taken out (Rule 4)."""
    text = _KEYS.sub(CREDENTIAL, text)
    text = _BEARER.sub(lambda match: f"{match.group(1)} {CREDENTIAL}", text)
    return _SECRET_VALUE.sub(lambda match: f"{match.group(1)}{CREDENTIAL}", text)


def without_topology(text: str, names: Iterable[str] = ()) -> str:
    """`text` with every address and every one of `names` (provider or node ids) taken
    out (Rule 2), and every credential (Rule 4)."""
    text = without_credentials(text)
    text = _URL.sub(ADDRESS, text)
    text = _SOCKET_TUPLE.sub(ADDRESS, text)
    text = _IPV6.sub(ADDRESS, text)
    text = _IPV4.sub(ADDRESS, text)
    text = _HOST_PORT.sub(ADDRESS, text)
    text = _NAMED.sub(lambda match: f"the {match.group(1).lower()}", text)
    for name in sorted({name for name in names if name}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-])'?{re.escape(name)}'?(?![\w.-])", "the provider", text)
    return text


#: What an upstream's error `code` or `param` may look like to reach a caller (Rule 5).
_IDENTIFIER: Final = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,64}")


def upstream_identifier(text: str | None, names: Iterable[str] = ()) -> str | None:
    """An upstream's error `code` or `param` as a caller may see it, or None (Rule 5);
    `names`: the provider and node ids it must not hold."""
    if text is None or not _IDENTIFIER.fullmatch(text):
        return None
    return text if without_topology(text, names) == text else None


def with_request_id(text: str, request_id: str) -> str:
    """`text` ending with the request id (Rule 3)."""
    if not request_id:
        return text
    return f"{text} (request id {request_id})"
