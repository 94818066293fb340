"""Which tokenizer endpoint a runtime offers, learnt from its answers.

Counting a prompt's tokens with the runtime's own tokenizer beats any estimate (Anthropic's
`count_tokens`, design §14). Runtimes offer one under different names, none under `/v1`:

    llama.cpp (llama-server)  POST /tokenize               {"content"}         -> {"tokens"}
    vLLM                      POST /tokenize               {"model", "prompt"} -> {"count", ...}
    llama-cpp-python          POST /extras/tokenize/count  {"model", "input"}  -> {"count"}

Rules:
1. The dialect is not known from the provider's type (a `vllm`-type provider may be
   llama.cpp), so it is learnt: the first count asks `/tokenize` with a body both servers
   read (`content` for llama.cpp, `model` and `prompt` for vLLM; each ignores the
   other's fields), and the answer tells which one it was (vLLM answers a `count`).
   Later counts send only the dialect's own fields.
2. A 404 or 405 means there is no such route: the next candidate is tried
   (`/extras/tokenize/count`); when none is left the runtime has no tokenizer endpoint,
   which is remembered for the adapter's life.
3. Any other failure (an error status, an answer that is not a count) teaches nothing:
   this count falls back to the estimator and the next one asks again.

Pure: the adapter sends what `plan` says and feeds the answers to `learn`.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

__all__ = ["Dialect", "TokenizerEndpoint"]

Dialect = Literal["llama_cpp", "vllm", "llama_cpp_python"]
_Candidate = Literal["tokenize", "llama_cpp_python"]
"""`tokenize`: `/tokenize` of a dialect not known yet (llama.cpp or vLLM)."""

_PATHS: Final[dict[Dialect | _Candidate, str]] = {
    "tokenize": "/tokenize",
    "llama_cpp": "/tokenize",
    "vllm": "/tokenize",
    "llama_cpp_python": "/extras/tokenize/count",
}


class _Probe(msgspec.Struct, omit_defaults=True):
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    input: str | None = None


class _Answer(msgspec.Struct):
    count: int | None = None
    tokens: list[msgspec.Raw] | None = None


_encode: Final = msgspec.json.Encoder().encode
_decode_answer: Final = msgspec.json.Decoder(_Answer).decode


class TokenizerEndpoint:
    """One runtime's tokenizer endpoint, as far as it is known (see the module rules)."""

    __slots__ = ("_absent", "dialect")

    def __init__(self) -> None:
        self.dialect: Dialect | None = None
        """Known once a count succeeded."""
        self._absent = False

    @property
    def absent(self) -> bool:
        """The runtime has none (Rule 2)."""
        return self._absent

    def plan(self) -> list[Dialect | _Candidate]:
        """The endpoints to ask, in order, until one answers a count."""
        if self._absent:
            return []
        if self.dialect is not None:
            return [self.dialect]
        return ["tokenize", "llama_cpp_python"]

    @staticmethod
    def path(candidate: Dialect | _Candidate) -> str:
        """The candidate's path at the server root."""
        return _PATHS[candidate]

    @staticmethod
    def body(candidate: Dialect | _Candidate, model: str, text: str) -> bytes:
        match candidate:
            case "tokenize":
                probe = _Probe(model=model, prompt=text, content=text)
            case "llama_cpp":
                probe = _Probe(content=text)
            case "vllm":
                probe = _Probe(model=model, prompt=text)
            case "llama_cpp_python":
                probe = _Probe(model=model, input=text)
        return _encode(probe)

    def learn(self, candidate: Dialect | _Candidate, status: int, body: bytes) -> int | None:
        """The count in an answer (learning the dialect from it), or None: a missing route
        (`missing(status)`: ask the next candidate, Rule 2) or a failure (Rule 3)."""
        if self.missing(status):
            if self.dialect is not None:
                self.dialect = None  # the runtime behind the URL changed: probe afresh
            elif candidate == "llama_cpp_python":  # the last candidate
                self._absent = True
            return None
        if not 200 <= status < 300:
            return None
        try:
            answer = _decode_answer(body)
        except (msgspec.DecodeError, RecursionError):
            return None
        if answer.count is not None and answer.count >= 0:
            count = answer.count
            found: Dialect = "llama_cpp_python" if candidate == "llama_cpp_python" else "vllm"
        elif answer.tokens is not None:
            count = len(answer.tokens)
            found = "llama_cpp"
        else:
            return None
        if candidate == "tokenize":
            self.dialect = found
        elif self.dialect is None:
            self.dialect = candidate
        return count

    @staticmethod
    def missing(status: int) -> bool:
        """Whether an answer with `status` means the route does not exist (Rule 2)."""
        return status in (404, 405)
