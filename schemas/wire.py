"""The runtime wire between Edge and Node (design §3).

One websocket per Node, one msgpack-encoded message per websocket message. Every message
is a tagged Struct (`type` field); tags are explicit so renaming a class never changes
the wire. There is one union per direction, and one encoder/decoder pair built once and
reused by everyone. Unknown fields are ignored (an older peer skips what a newer one
adds); an unknown `type` or a malformed frame raises `WireError`, which the receiver turns
into a `reject`/close with the reason instead of crashing.

Payloads travel as raw bytes, never re-encoded in between: `run.body` is the caller's
OpenAI JSON request (the Node hands it to the upstream as it is); what comes back is
already shaped for the caller by the Node (design §3): every chunk and response
carries the caller's alias in `model`, and stream chunks arrive framed as server-sent
events, so the Edge writes them to the caller without parsing them.

Run events travel in batches (`run_events`): everything a Node's writer finds queued in
one pass, chunks of several runs and the ends of runs, leaves as one websocket message.
Per-token work scales out with the Nodes; the Edge pays one parse and one scheduling pass
per batch, not per token.

A Node may hold links to several Edges at once (replicas, or an old and a new Edge process
during a zero-downtime restart; design §3 "Several Edges", §13). The slots of its providers
are counted on the Node across all links: a run that finds its provider full is answered
at once with `run_failed{code: busy}`, and each Edge hears, in `load`, how many runs the
*other* links hold, so it ranks and admits with the provider's whole load. An Edge that
is going away sends `goaway`: the Node dials it again for new runs and keeps the old link
only until its runs finish.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

import msgspec

from schemas.config import LifecycleFlag, NodeConfig
from schemas.hosted_tools import HostedTools
from schemas.limits import (
    MAX_EVENTS_PER_MESSAGE,
    MAX_FRAME_BYTES,
    MAX_NODE_PROVIDERS,
    MAX_REPORTED_TOKENS,
)
from schemas.protocols import CallerProtocol

#: Bumped on any incompatible change; travels in `hello` and `welcome`. A peer speaking
#: another version is refused at the handshake with a reason naming both versions.
#: 2: batched run events (`run_events`), Node-side shaping (`run.reply_model`,
#: `run.strip_usage`, chunks framed as server-sent events).
#: 3: several Edges per Node: `goaway`, `load`, `run_failed{code: busy}`, `run.long`,
#: `config_time` in `welcome` and `refresh`.
#: 4: caller protocols (`messages`, `responses`, `count_tokens` operations,
#: `run.caller_headers`, `run.keep_output`, `ProviderStatus.protocols`).
#: 5: models' load states (`ProviderStatus.model_states`, `max_loaded`) and the Edge's
#: `model_command` (load or unload a model on a provider), answered `model_command_done`.
PROTOCOL_VERSION = 5

#: What a Node can do beyond its protocol version, named in `hello.features` (a peer
#: that does not name a feature never gets its messages, so versions mix freely).
#: `probe`: the Node takes `probe` and answers it with a `status` naming the probed
#: providers (`Status.probed`).
FEATURE_PROBE: Final = "probe"
#: `pins`: the Node takes `model_command`s `pin` and `unpin` and keeps the idle clocks
#: of `NodeConfig.idle` (design §18.4). An Edge sends a Node without it no pin: an
#: operator's pin then holds on that Edge alone (its placement, its reloads).
FEATURE_PINS: Final = "pins"


Operation = str
"""What a run asks of its provider: one of the operations below, or a caller protocol
registered with both processes (a run of it has its name; the Node refuses an operation
it has no translator for with `unsupported_operation`).

- `chat`, `completion`, `embedding`: the OpenAI request of that name, sent as it is.
- `messages` (Anthropic Messages) and `responses` (OpenAI Responses): the caller's body in
  that protocol. The Node sends it natively to a provider that speaks it, or translates
  it to chat completions and the reply (and each stream event) back (design §14). Either
  way what comes back is in the caller's protocol: a stream's chunks are whole
  server-sent events with their `event:` line (`event: NAME\ndata: {...}\n\n`), a
  non-stream run's `run_done.response` is the protocol's response object.
- `count_tokens`: Anthropic's `POST /v1/messages/count_tokens`; `body` is that request
  (`model` = `target`), never a stream. The run ends with `run_done.response =
  {"input_tokens": N}` and a zero `usage` (counting consumes nothing). N comes from the
  provider's own `/v1/messages/count_tokens` when it speaks Messages natively, else from
  the runtime's tokenizer endpoint (llama.cpp, vLLM: `POST /tokenize`; llama-cpp-python:
  `POST /extras/tokenize/count`) over the text of the request translated to chat, else
  from IOP's estimator (`schemas.tokens`); `usage_source` is `provider` for the first two,
  `estimated` for the last. A request that cannot be translated fails as for `messages`
  (`invalid_request`, status 400, the message naming the field).
"""
Health = Literal["available", "busy", "draining", "unavailable", "unknown"]
"""A provider's health as its Node sees it (design §4 item 11, §12):

- `available`: answers its probes; takes runs up to capacity.
- `busy`: its runs are producing output, so its Node does not probe it meanwhile (a
  probe may go unanswered, or even cut the generation: llama.cpp's server does both), or
  a probe timed out while they were. The runtime is alive and generating; it stays in
  the pool up to capacity.
- `draining`: its Node is shutting down; it finishes what it runs and takes nothing new.
- `unavailable`: down (refused, probes failing with nothing in flight, runs stalled).
- `unknown`: not probed yet (a node that just connected).
"""


UsageSource = Literal["provider", "estimated"]
"""Where a run's token counts come from (design §7): the provider's own report, or IOP's
estimate (`schemas.tokens`) when the provider gave none (no usage chunk, a cut stream, a
cancelled run)."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire message."""


class Usage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A run's token counts. Zeros are left off the wire (a peer reads them back as 0)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    """Of `prompt_tokens`, those the runtime took from its prefix cache instead of
    computing (OpenAI `usage.prompt_tokens_details.cached_tokens`, Anthropic
    `cache_read_input_tokens`, llama.cpp `timings.cache_n`); 0 when it does not say. An
    older Node leaves it out, an older Edge ignores it."""

    def bounded(self) -> Usage:
        """These counts as any run can have them; this very object when they are so. Each
        count is in `0..MAX_REPORTED_TOKENS`, `total_tokens` at least the other two's sum,
        `cached_tokens` at most `prompt_tokens` (cached tokens are part of the prompt).
        An upstream's count is any JSON integer: the Node bounds what it sends (one msgpack
        cannot carry fails the writer of the link, with every run on it), and the Edge
        what it is sent (`core.node_input` Rule 1)."""
        prompt, completion = self.prompt_tokens, self.completion_tokens
        if (
            0 <= prompt <= MAX_REPORTED_TOKENS
            and 0 <= completion <= MAX_REPORTED_TOKENS
            and prompt + completion <= self.total_tokens <= MAX_REPORTED_TOKENS
            and 0 <= self.cached_tokens <= prompt
        ):
            return self  # as nearly every report is: nothing to build
        prompt = min(max(prompt, 0), MAX_REPORTED_TOKENS)
        completion = min(max(completion, 0), MAX_REPORTED_TOKENS)
        total = min(max(self.total_tokens, 0), MAX_REPORTED_TOKENS)
        bounded = Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=max(total, prompt + completion),
            cached_tokens=min(max(self.cached_tokens, 0), prompt),
        )
        return self if bounded == self else bounded


# --- handshake -----------------------------------------------------------------------


class Hello(Message, tag="hello", frozen=True, kw_only=True):
    protocol: int
    node_id: str
    token: str
    agent_version: str = ""
    features: list[str] = []
    """The features the Node speaks (`FEATURE_PROBE`)."""


class Welcome(Message, tag="welcome", frozen=True, kw_only=True):
    protocol: int
    edge_id: str
    revision: int
    node_config: NodeConfig
    heartbeat_s: float = 5.0
    config_time: float = 0.0
    """When this Edge took `node_config` (unix seconds): a Node linked to several Edges
    runs the newest config any of them sent (see `Refresh.config_time`)."""


class Reject(Message, tag="reject", frozen=True, kw_only=True):
    """Sent before the Edge closes a connection it will not serve (or by either side on a
    malformed frame). `code` is machine-readable, `reason` is for humans.

    The Edge's codes: `bad_frame`, `protocol_error`, `handshake_timeout` (transient: the
    Node retries as after any failure) and the `PERMANENT_REJECTIONS`, which no retry
    fixes soon: `bad_token`, `unknown_node`, `unsupported_protocol`, and `node_replaced`
    (sent on an established session when a new connection with the same node id took its
    place: two Nodes share one id, or a half-dead connection was superseded). The Node
    uses `protocol_version` when the Edge's `welcome` speaks another protocol.
    """

    code: str
    reason: str


#: The node id connected again: the new connection replaced this session.
NODE_REPLACED: Final = "node_replaced"
#: `reject` codes that mean the Edge saw this Node and refused it: retrying soon cannot
#: help, so a Node gives up after a few of them in a row (see `iop_node.uplink.backoff`).
PERMANENT_REJECTIONS: Final = frozenset(
    {"bad_token", "unknown_node", "unsupported_protocol", "protocol_version", NODE_REPLACED}
)


# --- runs ------------------------------------------------------------------------------


class Run(Message, tag="run", frozen=True, kw_only=True):
    run_id: str
    provider_id: str
    target: str
    """The served model name upstream (the Edge mapped the alias; the Node never does)."""
    operation: Operation
    body: bytes
    stream: bool = False
    reply_model: str = ""
    """The alias the caller asked for: the Node writes it into every chunk and response
    (empty: leave `model` as the upstream wrote it)."""
    strip_usage: bool = False
    """The caller did not ask for usage in its stream: the Node drops the usage-only
    chunk it asked the upstream for on the Edge's behalf (and reports usage in
    `run_done`)."""
    request_id: str = ""
    """The caller's request this run serves ("" = `run_id`). A retry on another provider has
    its own `run_id` (`req_x.1`); adapters that make up response ids use this one, so the
    id a caller sees stays tied to its request."""
    long: bool = False
    """A long-context run (design §4 step 4): it holds one of the provider's long slots
    on the Node too."""
    caller_headers: dict[str, str] = {}
    """Protocol headers of the caller's request that a native upstream must see as they
    were sent (`anthropic-version`, `anthropic-beta`); never credentials."""
    keep_output: bool = False
    """The Edge stores this run's result (a Responses request with `store: true`): the
    Node puts the final response object, in the caller's protocol, in `run_done.response`
    even for a stream. The body says `store: false` (the runtime keeps nothing), and the
    response says `store: true`, as the caller asked."""
    traceparent: str = ""
    """W3C trace context (design §16): the Edge's span of the caller's request when the
    Edge traces, else the caller's own `traceparent` as it came ("" = none). The Node's
    spans continue it, and the upstream request carries it on."""
    tracestate: str = ""
    """The W3C `tracestate` that goes with `traceparent`."""
    previous_response_id: str = ""
    """The stored Responses conversation this run continues, as its caller named it
    ("" = none). The Edge sends the conversation itself in the body, without the id (the
    runtime keeps nothing), so the Node writes it back into the response's echo."""
    hold_tail: bool = False
    """The Edge writes `run_done.tail` (see there): the Node holds a Messages or Responses
    stream's last events back for it. An Edge that does not say so gets them as chunks,
    as before the field existed (a Node and an Edge of different releases still agree)."""
    hosted_tools: HostedTools = "drop"
    """What a translated Messages or Responses run does with the tools only a vendor's
    service runs (`schemas.hosted_tools`): leave them out, or refuse the run (the
    model's `generation.hosted_tools`)."""


class Cancel(Message, tag="cancel", frozen=True, kw_only=True):
    run_id: str


class Probe(Message, tag="probe", frozen=True, kw_only=True):
    """Probe these providers now (Edge -> Node, only to a Node that names `FEATURE_PROBE`).

    Sent when callers would be refused because a model's providers are all
    `unavailable`: a runtime that came back is routable as soon as a probe says so, not
    at its next periodic probe. The Node probes each at most once a second, one probe at
    a time, and answers with a `status` whose `probed` names them, changed or not."""

    providers: list[str]


class RunDone(Message, tag="run_done", frozen=True, kw_only=True):
    run_id: str
    usage: Usage | None = None
    response: bytes | None = None
    usage_source: UsageSource | None = None
    """None: a Node that does not say; `usage` then is the provider's when present."""
    tail: bytes | None = None
    """A Messages or Responses stream's last events, caller-ready (framed as its chunks
    are): Anthropic's `message_delta` and `message_stop`, a Responses `response.completed`
    or `response.incomplete`. They tell the caller the reply is whole, and a caller may
    hang up the moment it reads them (Codex CLI does), so they travel with the run's end
    instead of ahead of it: the Edge records the end, then writes them, where it writes a
    chat stream's `data: [DONE]`. A caller that leaves after reading them left a
    completed run. Only for a run with `hold_tail`; None for chat and completions (the
    Edge ends those streams itself) and from a Node that does not know the field (the
    events came as chunks)."""


class FailureCode(StrEnum):
    """Why a run failed: one vocabulary for the Node that reports and the Edge that acts.

    The upstream's answer (the Node's adapters report these):

        upstream_unreachable    connect refused, DNS, connect timeout
        upstream_timeout        no answer within the adapter's deadlines
        upstream_error          5xx, broken connection, a body that is not what it says
        upstream_stream_error   anything after the first chunk went out
        upstream_busy           429/503: a load signal (`capacity`), not a failure
        upstream_misconfigured  401/403/404: the provider's key or model is wrong
        upstream_rejected       another 4xx: the upstream refused *this request*
        invalid_request         an adapter without an upstream (sim, cli) refused it
        model_not_found         the provider does not serve the target model
        unsupported_operation   the provider does not do this operation (cli: embeddings)
        unsupported_request     the provider cannot take this form of request
        cli_failed              the CLI tool could not start or exited non-zero

    The Node's own:

        busy                    every slot of the provider is taken (by the runs of all
                                the Node's Edge links): `capacity`, retry when one frees
        unknown_provider        no such provider here (a refresh in flight)
        adapter_closed          the provider's adapter was retired under the run
        registry_retired        a refresh replaced the registry; its drain timed out
        node_stopping           the Node is shutting down
        cancelled               the Edge sent `cancel`
        duplicate_run           a run with this id is already active
        internal                an adapter bug (the run fails, never the Node)

    The Edge's own diagnoses (never sent by a Node):

        node_lost               the Node's connection ended during the run
        caller_too_slow         the caller fell a whole buffer behind the provider
        bad_chunk, bad_response what the Node sent is not an OpenAI JSON object
        request_too_large       the run message would exceed the wire's frame limit
        shutting_down           the Edge stopped before the run ended (grace period over)

    The Node's answer to a provider whose output cannot travel:

        response_too_large      a chunk or response exceeds the wire's payload limit
    """

    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_STREAM_ERROR = "upstream_stream_error"
    UPSTREAM_BUSY = "upstream_busy"
    UPSTREAM_MISCONFIGURED = "upstream_misconfigured"
    UPSTREAM_REJECTED = "upstream_rejected"
    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    UNSUPPORTED_OPERATION = "unsupported_operation"
    UNSUPPORTED_REQUEST = "unsupported_request"
    CLI_FAILED = "cli_failed"
    BUSY = "busy"
    UNKNOWN_PROVIDER = "unknown_provider"
    ADAPTER_CLOSED = "adapter_closed"
    REGISTRY_RETIRED = "registry_retired"
    NODE_STOPPING = "node_stopping"
    CANCELLED = "cancelled"
    DUPLICATE_RUN = "duplicate_run"
    INTERNAL = "internal"
    NODE_LOST = "node_lost"
    CALLER_TOO_SLOW = "caller_too_slow"
    BAD_CHUNK = "bad_chunk"
    BAD_RESPONSE = "bad_response"
    REQUEST_TOO_LARGE = "request_too_large"
    SHUTTING_DOWN = "shutting_down"
    RESPONSE_TOO_LARGE = "response_too_large"


class RunFailed(Message, tag="run_failed", frozen=True, kw_only=True):
    """A run ended without success.

    `retryable` tells the Edge the failure happened before the upstream produced
    anything and another provider may succeed (connect refused, upstream 5xx, 429/503).
    `capacity` marks a 429/503 from the upstream: a load signal, not a health failure
    (`retry_after_s`: for how long, when the upstream said).
    `status` is the upstream's HTTP status when the failure is its error answer: the
    Edge's blame rules (design §4 item 10) read it. `upstream_code` and `param` are the
    upstream's error code and the request field it named (OpenAI's `code` and `param`,
    e.g. `context_length_exceeded` and `messages`): a caller acts on them, so a request
    the upstream refused reaches the caller with them.
    """

    run_id: str
    code: FailureCode
    message: str
    retryable: bool = False
    capacity: bool = False
    status: int | None = None
    usage: Usage | None = None
    """What the run consumed before it failed (an estimate unless the provider said)."""
    usage_source: UsageSource | None = None
    upstream_code: str | None = None
    param: str | None = None
    reply_fault: bool = False
    """The upstream answered, and its reply was empty or malformed (no event in a 200
    stream, output that is not JSON, tool-call arguments that are no JSON object). Such a
    reply may be the provider's fault or the request's (a runtime that cannot answer one
    request shape), so the Edge blames the provider only when other requests to it fail
    too (design §4 item 9)."""
    retry_after_s: float | None = None
    """With `capacity`: how long the upstream asked to be left alone (its `Retry-After`,
    in seconds); the Edge rests the provider that long (design §4 item 9)."""


class RunEvents(Message, tag="run_events", frozen=True, kw_only=True):
    """Run events of one writer pass (Node -> Edge).

    `chunks`: per run, caller-ready bytes (one or more complete server-sent events:
    `data: {...}\n\n` for chat and completions, `event: NAME\ndata: {...}\n\n` for
    Messages and Responses), in the order they were produced; a run appears at most once.
    `ends`: runs that ended, applied after every chunk of this message (a run's end never
    comes before its chunks; a stream's last events may come inside it, `RunDone.tail`)."""

    chunks: Annotated[list[tuple[str, bytes]], msgspec.Meta(max_length=MAX_EVENTS_PER_MESSAGE)] = []
    ends: Annotated[list[RunDone | RunFailed], msgspec.Meta(max_length=MAX_EVENTS_PER_MESSAGE)] = []


# --- config and health -----------------------------------------------------------------


class Refresh(Message, tag="refresh", frozen=True, kw_only=True):
    revision: int
    node_config: NodeConfig
    config_time: float = 0.0
    """When the Edge applied this config (unix seconds). A Node linked to several Edges
    keeps the newest config it was sent: a replica that reconnects with an older one
    (not refreshed yet) does not undo another replica's refresh."""


class RefreshAck(Message, tag="refresh_ack", frozen=True, kw_only=True):
    revision: int
    ok: bool
    error: str | None = None


ModelLoadState = Literal["loaded", "loading", "unloaded", "sleeping", "failed"]
"""Where a served model stands in its runtime's memory (design §18): `loaded` runs start
at once; `loading` is on its way; `unloaded` and `sleeping` need a load (a sleeping one,
vLLM's sleep mode, wakes in seconds); `failed` could not be loaded (`reason` says why)."""


class ModelState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One served model's state in its runtime, as the runtime itself reports it."""

    name: str
    """The served model name (`models[].providers`' value), as the runtime lists it."""
    state: ModelLoadState
    reason: str | None = None
    pinned: bool = False
    """Some Edge pinned it on this runtime (the Node says so, not the runtime): every Edge
    sharing the Node keeps it there, as it does its own pins (design §18.4)."""


class ProviderStatus(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Not tracked by the cycle collector (`gc=False`): strings and lists of them, never a
    cycle, and a fleet's Nodes send thousands a second while a refresh is pushed."""

    id: str
    health: Health
    models: list[str] = []
    detail: str | None = None
    lifecycle: list[LifecycleFlag] | None = None
    """The lifecycle operations the provider's runtime API offers, as the adapter found
    them (e.g. Ollama's native API); None when the adapter cannot tell."""
    protocols: list[CallerProtocol] | None = None
    """The caller protocols the provider speaks natively as its Node knows now: the
    configured ones less any the upstream answered 404/405 on (design §14); None when the
    Node does not say (the Edge then assumes the configured ones)."""
    model_states: list[ModelState] | None = None
    """Each served model's load state, from the runtime's lifecycle API (design §18); None
    when the runtime does not say (every model it lists is then taken as loaded)."""
    max_loaded: int | None = None
    """How many models the runtime keeps loaded at once, where it says (llama.cpp's
    `--models-max`); None: it does not say."""


class Status(Message, tag="status", frozen=True, kw_only=True):
    providers: Annotated[list[ProviderStatus], msgspec.Meta(max_length=MAX_NODE_PROVIDERS)]
    probed: Annotated[list[str], msgspec.Meta(max_length=MAX_NODE_PROVIDERS)] = []
    """The providers whose `probe` this report answers (their status is the probe's)."""


# --- several Edges -----------------------------------------------------------------------


class ProviderLoad(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    in_flight: int
    """Runs that the Node's *other* Edge links hold on this provider."""
    long_in_flight: int = 0
    """Of those, long-context runs."""


class Load(Message, tag="load", frozen=True, kw_only=True):
    """What the Node's other Edge links hold on each provider (Node -> Edge).

    Sent to each link when its view changes (coalesced: at most one per short interval),
    and right after a `busy` answer. The Edge counts these runs against capacity with its
    own; a link that never shares its Node hears nothing (the Edge starts from zero)."""

    providers: Annotated[list[ProviderLoad], msgspec.Meta(max_length=MAX_NODE_PROVIDERS)]


class GoAway(Message, tag="goaway", frozen=True, kw_only=True):
    """The Edge is going away (Edge -> Node): dial it again now for new runs; this link
    stays only until the runs on it finish, then the Edge closes it."""

    reason: str = ""


# --- models on demand (design §18) ---------------------------------------------------------

ModelAction = Literal["load", "unload"]
"""What a runtime is asked to do with a model."""
PinAction = Literal["pin", "unpin"]
"""`pin`: load the model (as `load`) and keep it from idle unloads while this link
lasts or until `unpin` (which unloads nothing). Only to a Node naming `FEATURE_PINS`."""


class ModelCommand(Message, tag="model_command", frozen=True, kw_only=True):
    """Load (or wake) or unload a served model on one provider (Edge -> Node).

    The Node serialises a provider's commands and answers each with `model_command_done`
    once the runtime has done it (a load: the model is loaded, or failed); a command
    equal to one in progress (another Edge's, say) joins it rather than running twice."""

    command_id: str
    provider_id: str
    action: ModelAction | PinAction
    model: str
    """The served model name (`models[].providers`' value)."""


class ModelCommandDone(Message, tag="model_command_done", frozen=True, kw_only=True):
    """How a `model_command` ended (Node -> Edge); `error` says why it did not."""

    command_id: str
    ok: bool
    error: str | None = None


EdgeToNode = Welcome | Reject | Run | Cancel | Refresh | GoAway | Probe | ModelCommand
NodeToEdge = Hello | Reject | RunEvents | RefreshAck | Status | Load | ModelCommandDone


class WireError(Exception):
    """A frame that is not a valid message for this direction."""


_encoder = msgspec.msgpack.Encoder()
#: msgspec skips unknown fields recursively: a peer can nest them deeper than the
#: interpreter's stack allows, and the decoder says so with `RecursionError`.
_TOO_DEEP = "bad frame: nested too deeply"
_from_node = msgspec.msgpack.Decoder(NodeToEdge)
_from_edge = msgspec.msgpack.Decoder(EdgeToNode)


class FrameTooLarge(ValueError):
    """An encoded message would exceed `MAX_FRAME_BYTES`: sending it would cost the link."""


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def encode_bounded(message: Message) -> bytes:
    """`encode`, refusing a frame the peer would disconnect for (`FrameTooLarge`)."""
    frame = _encoder.encode(message)
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"a {type(message).__name__} message of {len(frame)} bytes exceeds the wire's "
            f"limit of {MAX_FRAME_BYTES} bytes"
        )
    return frame


def decode_from_node(frame: bytes | str) -> NodeToEdge:
    """Decode a frame the Edge received; raises `WireError` naming what is wrong."""
    if isinstance(frame, str):
        raise WireError("text frame: the runtime wire is binary msgpack")
    try:
        return _from_node.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad frame: {exc}") from None
    except RecursionError:
        raise WireError(_TOO_DEEP) from None


def decode_from_edge(frame: bytes | str) -> EdgeToNode:
    """Decode a frame the Node received; raises `WireError` naming what is wrong."""
    if isinstance(frame, str):
        raise WireError("text frame: the runtime wire is binary msgpack")
    try:
        return _from_edge.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad frame: {exc}") from None
    except RecursionError:
        raise WireError(_TOO_DEEP) from None
