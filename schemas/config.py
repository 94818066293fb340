"""The Edge config schema (design §2): one YAML file describes the Edge, its models and every Node.

The Structs here are the *shape*; `iop_edge.core.configuration.config` loads YAML into them,
collects every
error with its config path, and runs the cross-reference rules. Config Structs forbid
unknown fields so that a typo fails loudly instead of silently doing nothing. Node
provider Structs are also what travels to a Node in `welcome`/`refresh`, so the Node
reads the very same definitions the Edge validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.hosted_tools import HostedTools
from schemas.limits import MAX_NODE_PROVIDERS, MAX_PAYLOAD_BYTES
from schemas.protocols import BuiltinProtocol, default_protocols

ProviderType = Literal[
    "ollama", "vllm", "sglang", "lemonade", "lmstudio", "openai_api", "cli", "sim"
]
Category = Literal["api", "cli", "local_inference"]
LifecycleFlag = Literal["list_models", "load_model", "unload_model", "pull_model", "delete_model"]

#: Provider types that speak the OpenAI HTTP API upstream.
OPENAI_COMPATIBLE_TYPES: frozenset[str] = frozenset(
    {"vllm", "sglang", "lemonade", "lmstudio", "openai_api"}
)

NonEmptyStr = Annotated[str, Meta(min_length=1)]
Sha256Hex = Annotated[
    str, Meta(pattern=r"^[0-9a-f]{64}$", description="sha256 hex digest, 64 lowercase chars")
]
EnvVarName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
#: The largest number a config holds: counts below it are exact as floats too (limits are
#: kept as token buckets), and the refresh worker's wire (msgpack) carries them. A
#: larger one is no limit anyone means.
LARGEST_SETTING = 2**53
PositiveInt = Annotated[int, Meta(gt=0, le=LARGEST_SETTING)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=LARGEST_SETTING)]
PositiveFloat = Annotated[float, Meta(gt=0, le=LARGEST_SETTING)]
"""A positive, finite number (`.inf` is no setting)."""
#: A principal's share of a saturated model against the others (`principals[].weight`):
#: a thousandth to a thousand times the default's, so no charge rounds to 0 or infinity.
Weight = Annotated[float, Meta(ge=0.001, le=1000.0)]
#: A request body the node wire can carry in one message (design §3): no larger.
RequestBytes = Annotated[
    int,
    Meta(gt=0, le=MAX_PAYLOAD_BYTES, description="at most the node wire's payload limit"),
]

#: The `max_tokens` limit of a model that sets none (design §2, generation): generation
#: length is always bounded, so one request cannot occupy a provider indefinitely.
DEFAULT_MAX_TOKENS_LIMIT = 32_768
#: Seconds a stopping Edge lets in-flight requests finish before it ends them itself.
DEFAULT_SHUTDOWN_GRACE_S = 10.0
#: A caller that takes none of a response's bytes for this long is disconnected (nginx's
#: `send_timeout`, same default).
DEFAULT_SEND_TIMEOUT_S = 60.0


def default_category(provider_type: str) -> Category:
    """design §2.1: `openai_api` is an api, `cli` is a cli, everything else runs locally."""
    if provider_type == "openai_api":
        return "api"
    if provider_type == "cli":
        return "cli"
    return "local_inference"


class ConfigStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config Struct: immutable, keyword-only, typos rejected."""


class TlsSection(ConfigStruct, frozen=True, kw_only=True):
    cert_file: NonEmptyStr
    key_file: NonEmptyStr


#: How long a stored Responses response is kept after it was stored or last continued
#: (OpenAI keeps them 30 days).
DEFAULT_RESPONSES_MAX_AGE_S = 30 * 24 * 3600.0
#: How many stored Responses responses an Edge (or replicas sharing a ledger) keeps.
DEFAULT_RESPONSES_MAX_STORED = 10_000
#: The bytes of stored responses kept at most, all principals together (their request
#: items and response objects as stored): a small `state_dir` is not filled by them.
DEFAULT_RESPONSES_MAX_BYTES = 256 * 1024 * 1024
#: The bytes of stored responses one principal may hold: one principal cannot take the
#: store (or the disk under it) from the others.
DEFAULT_RESPONSES_MAX_BYTES_PER_PRINCIPAL = 32 * 1024 * 1024
#: Free space the store leaves in `state_dir` (SQLite) for the usage journal and ledger:
#: metering never waits for room that stored responses took.
DEFAULT_RESPONSES_MIN_FREE_BYTES = 32 * 1024 * 1024
#: The bytes of a stored conversation a `previous_response_id` may continue: longer ones
#: are refused before they are loaded whole, so one turn costs bounded memory and time.
DEFAULT_RESPONSES_MAX_CONVERSATION_BYTES = 16 * 1024 * 1024
#: Usage records an Edge keeps in memory while its journal in `state_dir` cannot be
#: written (a full disk), about 300 bytes each.
DEFAULT_LEDGER_BUFFER_RECORDS = 100_000
#: What an Edge does once that buffer is full: refuse new runs (503
#: `metering_unavailable`) or serve them unmetered.
WhenUnwritable = Literal["refuse", "serve"]


class ResponsesSection(ConfigStruct, frozen=True, kw_only=True):
    """The OpenAI Responses store (design §14): responses kept for `previous_response_id`,
    `GET` and `DELETE /v1/responses/{id}`, in the usage ledger's database. The oldest go
    first once either bound is passed."""

    max_age_s: PositiveFloat = DEFAULT_RESPONSES_MAX_AGE_S
    """Seconds a response is kept after it was stored or last continued."""
    max_stored: PositiveInt = DEFAULT_RESPONSES_MAX_STORED
    """Responses kept at most, all principals together."""
    max_bytes: PositiveInt = DEFAULT_RESPONSES_MAX_BYTES
    """Bytes of stored responses kept at most, all principals together (the least
    recently used go first)."""
    max_bytes_per_principal: PositiveInt = DEFAULT_RESPONSES_MAX_BYTES_PER_PRINCIPAL
    """Bytes of stored responses one principal holds at most: past it, its responses are
    answered but not stored (`store: false`) until some expire or it deletes some."""
    min_free_bytes: NonNegativeInt = DEFAULT_RESPONSES_MIN_FREE_BYTES
    """Room in `state_dir` kept for the usage journal and ledger (SQLite only): the disk's
    free space and the database's free pages. Nothing is stored below it, and as the
    usage records grow into it the least recently used responses go."""
    max_conversation_bytes: PositiveInt = DEFAULT_RESPONSES_MAX_CONVERSATION_BYTES
    """Bytes of stored conversation a `previous_response_id` continues at most (400
    `conversation_too_large` past it)."""


#: The OTLP wire formats IOP exports traces in (the OpenTelemetry SDK's HTTP exporter).
OtlpProtocol = Literal["http/protobuf"]
#: `OTEL_TRACES_SAMPLER`'s values that need no extra package.
TraceSampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]


class TelemetrySection(ConfigStruct, frozen=True, kw_only=True):
    """OpenTelemetry traces (design §16): off unless an endpoint is set here or in the
    standard `OTEL_EXPORTER_OTLP_*` environment variables. A key set here wins over its
    variable; `OTEL_SDK_DISABLED=true` turns tracing off whatever is set
    (`schemas.runtime.telemetry`)."""

    endpoint: NonEmptyStr | None = None
    """The OTLP/HTTP receiver: its base URL (`http://collector:4318`; spans go to
    `/v1/traces` under it) or the full URL ending in `/v1/traces`."""
    protocol: OtlpProtocol | None = None
    """None: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or `OTEL_EXPORTER_OTLP_PROTOCOL`, else
    `http/protobuf`."""
    sampler: TraceSampler | None = None
    """None: `OTEL_TRACES_SAMPLER`, else `parentbased_always_on` (a caller's sampled
    trace is always continued)."""
    sampler_arg: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    """The ratio of the `*traceidratio` samplers; None: `OTEL_TRACES_SAMPLER_ARG`, else 1."""
    service_name: NonEmptyStr | None = None
    """The `service.name` of the spans; None: `OTEL_SERVICE_NAME`, else `iop-edge`
    (`iop-node` on a Node)."""


class EdgeSection(ConfigStruct, frozen=True, kw_only=True):
    id: NonEmptyStr = "edge-1"
    listen: NonEmptyStr = "0.0.0.0:7700"
    state_dir: NonEmptyStr = "./var"
    tls: TlsSection | None = None
    shutdown_grace_s: PositiveFloat = DEFAULT_SHUTDOWN_GRACE_S
    ledger: NonEmptyStr | None = None
    """The usage ledger: None = SQLite in `state_dir`; `postgresql://USER@HOST/DB` = a
    PostgreSQL ledger Edge replicas share (no password in it, see below)."""
    ledger_password_env: EnvVarName | None = None
    """The environment variable holding the PostgreSQL password (else libpq's own
    `PGPASSWORD` or `~/.pgpass`)."""
    ledger_buffer_records: PositiveInt = DEFAULT_LEDGER_BUFFER_RECORDS
    """Usage records kept in memory, in order, while the journal in `state_dir` cannot be
    written (a full disk); they are written once it can."""
    ledger_when_unwritable: WhenUnwritable = "refuse"
    """Once that many records wait: `refuse` new runs (503 `metering_unavailable`, and
    `/readyz` says not ready) or `serve` them unmetered (their records are dropped and
    counted)."""
    responses: ResponsesSection = ResponsesSection()
    telemetry: TelemetrySection = TelemetrySection()
    """OpenTelemetry traces; read at startup (a change takes a restart)."""


class AdminSection(ConfigStruct, frozen=True, kw_only=True):
    listen: NonEmptyStr = "127.0.0.1:7701"


class PrincipalToken(ConfigStruct, frozen=True, kw_only=True):
    token_ref: NonEmptyStr
    token_hash_sha256: Sha256Hex
    principal_ref: NonEmptyStr
    alias: str | None = None


class ModelRoute(ConfigStruct, frozen=True, kw_only=True):
    """Legacy `openai.model_routes[]` entry: one route = one provider (design §2.4)."""

    model: NonEmptyStr
    provider: NonEmptyStr
    target: NonEmptyStr


class OpenAISection(ConfigStruct, frozen=True, kw_only=True):
    listen: NonEmptyStr = "0.0.0.0:8080"
    long_context_threshold_tokens: PositiveInt = 100_000
    max_request_bytes: RequestBytes = 8 * 1024 * 1024
    send_timeout_s: PositiveFloat = DEFAULT_SEND_TIMEOUT_S
    principal_tokens: list[PrincipalToken] = []
    model_routes: list[ModelRoute] = []


class CooldownPolicy(ConfigStruct, frozen=True, kw_only=True):
    failures: PositiveInt = 3
    seconds: PositiveFloat = 5.0


class DispatchSection(ConfigStruct, frozen=True, kw_only=True):
    max_queue: NonNegativeInt = 256
    queue_timeout_ms: PositiveInt = 30_000
    retries_before_first_byte: NonNegativeInt = 1
    cooldown: CooldownPolicy = CooldownPolicy()


class QueueOverride(ConfigStruct, frozen=True, kw_only=True):
    max_queue: NonNegativeInt | None = None
    queue_timeout_ms: PositiveInt | None = None


class GenerationPolicy(ConfigStruct, frozen=True, kw_only=True):
    defaults: dict[str, Any] = {}
    max_tokens_limit: PositiveInt = DEFAULT_MAX_TOKENS_LIMIT
    strip_agent_attribution: bool = True
    """Remove the attribution block Claude Code puts first in the system prompt of every
    Messages request (`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;
    cch=...;`) before the run. Its values change from one request to the next, and a
    runtime's prompt cache reuses only the unchanged prefix of a prompt: with the block
    in, every turn of an agent's conversation prefills its whole prompt again. The block
    says nothing to a model; only a block of exactly that shape is removed."""
    hosted_tools: HostedTools = "drop"
    """What a run translated for a runtime does with the tools only a vendor's service
    runs (OpenAI's `web_search`, `file_search`, `code_interpreter`, computer use;
    Anthropic's server tools, `schemas.hosted_tools`): `drop` leaves them out (the
    response's `iop-dropped-tools` header names them, and the Node logs it); `refuse`
    answers 400 naming the tool. A native runtime always gets them as they are."""


#: `models[].routing.load_bound`'s default: a provider one run in four ahead of the
#: least-loaded one (one run, on the usual four-slot runtime) still keeps its sessions.
DEFAULT_LOAD_BOUND = 0.25


class RoutingPolicy(ConfigStruct, frozen=True, kw_only=True):
    """How a model's runs choose among its providers with a free slot (design §4,
    `iop_edge.core.routing.affinity` and `iop_edge.core.routing.pool` Rule 7)."""

    affinity: bool = True
    """Send a conversation's turns to the provider that holds its prompt prefix (its
    session, its `previous_response_id` chain, or its prompt's own prefix), while that
    provider's load stays within `load_bound` of the least-loaded one. False: load ratio,
    priority and round-robin alone, as for a model without affinity."""
    load_bound: Annotated[float, Meta(ge=0.0, le=1.0)] = DEFAULT_LOAD_BOUND
    """How much busier (in load ratio, `in_flight / capacity`) than the least-loaded
    provider with a free slot the preferred provider may be and still take the run."""
    shared_prefixes: bool = False
    """Let the prefix index and the prompt-keyed choice be shared between principals:
    identical prompts of different principals (one system prompt and tool list every
    user sends) then meet on one provider. Off, each principal's prompts steer only its
    own runs: another principal cannot learn from where its runs land (or how fast they
    start) what someone else sent."""


class ModelLifecycle(ConfigStruct, frozen=True, kw_only=True):
    """When the runtimes that load models on demand load and unload this one (design
    §18.4, `iop_edge.core.lifecycle`). The Edge owns keep-alive: a caller's own
    (Ollama's `keep_alive`) is taken out of its request."""

    idle_unload_s: PositiveFloat | None = None
    """Unload the model from a runtime where no run has used it for this long (the Node
    keeps the clock: it sees every Edge's runs). None: the runtime decides."""
    keep_loaded: bool = False
    """Pin the model: it stays loaded on `max(preload, 1)` providers (loaded again when a
    runtime drops it), placement never unloads it there for another model, and it is
    never unloaded for idleness."""
    preload: NonNegativeInt = 0
    """Load the model on this many providers when the Edge starts and when a refresh adds
    it (or raises the number), placed as a run's load is (room first, then the model's
    rendezvous order: every Edge picks the same providers)."""


class ModelEntry(ConfigStruct, frozen=True, kw_only=True):
    id: NonEmptyStr
    display_name: str | None = None
    providers: dict[NonEmptyStr, NonEmptyStr]
    queue: QueueOverride | None = None
    generation: GenerationPolicy = GenerationPolicy()
    routing: RoutingPolicy = RoutingPolicy()
    lifecycle: ModelLifecycle = ModelLifecycle()


#: How a `sim` provider replies (`adapter.reply.mode`): `fill` writes exactly `max_tokens`
#: tokens and never calls a tool (a known, fixed length for tests and benchmarks);
#: `model` behaves like a model (a reply of a natural length, tool calls when tools are
#: offered; `iop_node.adapters.sim.sim_replies`).
SimReplyMode = Literal["fill", "model"]


class SimReply(ConfigStruct, frozen=True, kw_only=True):
    """What a `sim` provider says (`adapter.reply`)."""

    mode: SimReplyMode = "fill"
    median_tokens: PositiveInt = 120
    """`model` mode: the median length of a text reply, in tokens. Lengths follow a
    log-normal distribution around it; `max_tokens` only caps them (`finish_reason:
    length`), a reply that ends by itself says `stop`."""
    spread: Annotated[float, Meta(ge=0.0, le=3.0)] = 0.6
    """`model` mode: the log-normal's sigma; 0 makes every reply `median_tokens` long,
    0.6 puts nine replies in ten between about a third and 2.7 times the median."""
    seed: int = 0
    """`model` mode: mixed into every draw. The same seed and request always get the
    same reply; another seed, another one."""


class AdapterSettings(ConfigStruct, frozen=True, kw_only=True):
    """Adapter settings; which keys apply depends on the provider `type`.

    Credentials are env var *names* (`api_key_env`), resolved on the Node, so a secret
    never sits in the config or crosses the wire.
    """

    # OpenAI-compatible and ollama upstreams
    base_url: NonEmptyStr | None = None
    api_key_env: EnvVarName | None = None
    request_timeout_s: PositiveFloat = 600.0
    connect_timeout_s: PositiveFloat = 5.0
    first_byte_timeout_s: PositiveFloat | None = None
    health_interval_s: PositiveFloat = 10.0
    load_timeout_s: PositiveFloat = 300.0
    """How long the runtime may take to load (or wake) a model the Edge asked for (design
    §18): a load not done by then fails."""
    protocols: list[BuiltinProtocol] | None = None
    """The caller protocols the upstream speaks natively (design §14); None = the type's
    default (`schemas.protocols.DEFAULT_PROTOCOLS`). An explicit list is trusted: the Node
    does not second-guess it from a 404."""
    # cli
    command: list[NonEmptyStr] | None = None
    # sim
    max_loaded: PositiveInt | None = None
    """`sim`: how many of its models it holds at once, as a runtime that loads models on
    demand (`adapters.sim.sim_memory`); a run for another one loads it first. None: it holds
    every model always."""
    load_ms: NonNegativeInt = 0
    """`sim` with `max_loaded`: how long loading a model takes."""
    ttft_ms: NonNegativeInt = 20
    tokens_per_second: PositiveFloat = 200.0
    reply: SimReply = SimReply()
    prefix_cache_tokens: NonNegativeInt = 0
    """`sim`: the prompt tokens its prefix cache holds (least recently used prompts go
    first); 0 models no cache (every prompt token is prefilled, at no cost unless
    `prefill_us_per_token` says)."""
    prefill_us_per_token: Annotated[float, Meta(ge=0.0)] = 0.0
    """`sim`: microseconds of prefill per prompt token it does not find in its cache,
    added to the time to first token."""
    cached_prefill_us_per_token: Annotated[float, Meta(ge=0.0)] = 0.0
    """`sim`: microseconds per prompt token read from its cache (at most
    `prefill_us_per_token`)."""


class ProviderConfig(ConfigStruct, frozen=True, kw_only=True):
    id: NonEmptyStr
    type: ProviderType
    category: Category | None = None
    models: list[NonEmptyStr]
    capacity: PositiveInt
    long_context_slots: NonNegativeInt | None = None
    priority: int = 100
    enabled: bool = True
    lifecycle: list[LifecycleFlag] = []
    adapter: AdapterSettings = AdapterSettings()

    @property
    def effective_category(self) -> Category:
        return self.category or default_category(self.type)

    @property
    def native_protocols(self) -> tuple[BuiltinProtocol, ...]:
        """What the config says the upstream speaks natively: the operator's list, or the
        type's default."""
        if self.adapter.protocols is not None:
            return tuple(self.adapter.protocols)
        return default_protocols(self.type)


class NodeEntry(ConfigStruct, frozen=True, kw_only=True):
    id: NonEmptyStr
    alias: str | None = None
    token_hash_sha256: Sha256Hex
    providers: Annotated[list[ProviderConfig], Meta(max_length=MAX_NODE_PROVIDERS)] = []


#: `principals[].ref` that sets the limits of every principal not listed by name.
EVERY_OTHER_PRINCIPAL = "*"
ModelPatterns = Annotated[
    list[NonEmptyStr],
    Meta(min_length=1, description="model id glob patterns (`*`, `?`, `[...]`)"),
]


class PrincipalLimits(ConfigStruct, frozen=True, kw_only=True):
    """What one principal may use of a shared pool (design §15). Every limit is optional
    (absent = unlimited) and live-refreshable: a limit is policy, not a credential.

    `ref` is a `principal_ref` of `openai.principal_tokens`, `anonymous` when the API is
    open, or `"*"`: each principal not listed gets these limits, each its own."""

    ref: NonEmptyStr
    models: ModelPatterns | None = None
    """The model ids (glob patterns) the principal may use; None = every model. Any other
    model is unknown to it: 404 as for an id that does not exist, and not listed."""
    max_concurrent: PositiveInt | None = None
    """Runs in flight at once; more wait in the model's queue (not refused)."""
    requests_per_minute: NonNegativeInt | None = None
    tokens_per_minute: NonNegativeInt | None = None
    """Input + output tokens: estimated at admission, settled from the metered usage."""
    tokens_per_day: NonNegativeInt | None = None
    """A budget over the UTC day, counted from the usage ledger (survives restarts)."""
    weight: Weight = 1.0
    """Share of a saturated model against the other waiting principals (fair queueing),
    0.001 to 1000."""


class EdgeConfig(ConfigStruct, frozen=True, kw_only=True):
    edge: EdgeSection = EdgeSection()
    admin: AdminSection = AdminSection()
    openai: OpenAISection = OpenAISection()
    dispatch: DispatchSection = DispatchSection()
    models: list[ModelEntry] = []
    nodes: list[NodeEntry] = []
    principals: list[PrincipalLimits] = []


class IdleRule(msgspec.Struct, frozen=True, kw_only=True):
    """One model's `lifecycle.idle_unload_s` on one of a Node's providers, by the name
    the provider serves it under (the Node never maps aliases)."""

    provider_id: str
    model: str
    idle_unload_s: float


class NodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a Node receives in `welcome`/`refresh`: its own providers and the idle rules
    of the models they serve, nothing else."""

    node_id: str
    providers: list[ProviderConfig] = []
    idle: list[IdleRule] = []
    """An added field with a default: a Node that does not know it ignores it (and keeps
    no idle clock), an Edge that does not send it sends none."""


class ConfigError(msgspec.Struct, frozen=True, kw_only=True):
    """One problem in a config, named by its path (`nodes[0].providers[1].capacity`)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message
