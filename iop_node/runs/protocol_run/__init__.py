"""A run in a caller protocol on the Node: sent natively, or translated to chat and back.

Anthropic Messages and OpenAI Responses runs (and Anthropic's `count_tokens`) arrive with
the caller's body (design §14). Translation is per-token work, so it happens here, on
the Node (design §3), and the Edge relays the bytes it is given.

Each protocol is one `Translator` (`translator`: the interface and what every protocol
run shares; `messages`, `responses`: the protocols), found by the run's operation in
`registry`. Adding a protocol is one module with its translator, named in `registry`.

Rules:
1. Native first. A run goes to the upstream as it is when its adapter relays natively
   (`NativeRelay`) and the provider speaks the protocol (`ProtocolSupport`); every
   other run is translated.
2. No caller sees a missing native endpoint. A 404/405 on it teaches the provider's
   `ProtocolSupport` (unless the operator's explicit `adapter.protocols` says
   otherwise: the run then fails with the upstream's answer) and the same run is
   translated at once.
3. Translated, the body becomes a chat completions request (`iop_node.protocols`); what
   cannot be said there is the caller's error: `invalid_request`, status 400, the
   message naming the field. The adapter runs chat as for any chat run, and the reply,
   or each stream chunk, is translated back. A reply the caller's protocol cannot carry
   fails the run as the upstream's fault (`upstream_error`, `upstream_stream_error`
   once output went out).
   Tools only a vendor's service runs are left out first and logged, unless the run's
   model refuses them (`run.hosted_tools`, `schemas.hosted_tools`).
4. A translated stream always asks the runtime for its usage chunk (`include_usage`);
   the chunk feeds the caller's protocol's own usage report and never reaches the caller
   as a chat chunk. A runtime that reports none (llama.cpp's Python server ignores the
   option; a cut stream) gets IOP's estimate (`schemas.tokens`): prompt tokens from the
   translated chat request, output tokens from the chunks it sent. A whole reply
   without usage shows the caller the counts the run is metered at, never zeros. A
   Messages stream's `message_start`, written before the runtime counted anything,
   reports that estimate of the prompt's tokens (its `message_delta`, the runtime's).
   A chunk the adapter has read already (`reply.ParsedChunk`) reaches the translator
   with that reading, so a chunk of text (most of a stream) is decoded once.
5. The caller's alias is the model name everywhere: the translators write it, and the
   native relay rewrites it (`adapters.native`).
6. `keep_output`: the final response object of a Responses stream (native: the
   `response.completed` event's; translated: the translator's) travels in
   `run_done.response`, so the Edge can store it. Such a response says `store: true`,
   as its caller asked, though the body says `store: false` (the Edge is the store and
   the runtime keeps nothing): the translators write it, the native relay rewrites it.
   With `hold_tail`, the events that end a stream travel in `run_done.tail` instead of
   ahead of the end (native: the relay's `message_delta`/`message_stop` or last
   `response.*`; translated: all the translator's `finish` writes), so no caller reads
   them before the Edge recorded the run's end.
7. `count_tokens` asks, in order: the upstream's own `/v1/messages/count_tokens` when it
   speaks Messages natively; the runtime's tokenizer endpoint, over the text of the
   request translated to chat (`rendered_prompt`: the messages, tool calls and tool
   definitions); IOP's estimator over that same text. Both counts of text add the chat
   template's share (`schemas.tokens.template_tokens`), which neither sees.
8. Claude Code's beta extras (`anthropic-beta`, `context_management`,
   `cache_control.ttl`) go to a native Messages runtime as they are; one that refuses
   them (400 "Extra inputs are not permitted") gets the run again without them, once,
   and, when that one succeeds, every later run without them (`protocols.anthropic_betas`).
9. A translated run's upstream refusal names the field in the caller's terms: its
   `param`, a chat request's path, becomes the caller protocol's field
   (`Translator.chat_fields`: a Responses caller's overlong prompt is `input`, not
   `messages`).

The runner (`runner.py`) owns what is common to every run: the terminal message, the
output tally, cancellation, the payload bounds.
"""

from iop_node.runs.protocol_run.registry import ADAPTER_OPERATIONS, TRANSLATORS, Translators
from iop_node.runs.protocol_run.token_count import rendered_prompt
from iop_node.runs.protocol_run.translator import (
    Translation,
    Translator,
    estimate_prompt_tokens,
)

__all__ = [
    "ADAPTER_OPERATIONS",
    "TRANSLATORS",
    "Translation",
    "Translator",
    "Translators",
    "estimate_prompt_tokens",
    "rendered_prompt",
]
