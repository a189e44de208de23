"""Where ``kvservice serve`` takes its settings from: flags > environment > config file
> defaults.

Every option has one snake_case name used three ways: the TOML key (``num_blocks =
4096``), the flag (``--num-blocks``) and the environment variable
(``KVSERVICE_NUM_BLOCKS``). The config file is ``--config PATH`` or
``KVSERVICE_CONFIG``; without either, none is read (the embedded default needs none).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.core.block_hashing import HASH_FUNCTIONS
from kvservice.server.config import ServerConfig
from kvservice.server.event_loop import EVENT_LOOPS, default_event_loop
from kvservice.server.log import LOG_LEVELS
from kvservice.server.runtime import DEVICES, RUNTIMES
from kvservice.server.zmq_events.config import KVEventsConfigError, parse_kv_events_config

ENV_PREFIX = "KVSERVICE_"
CONFIG_ENV = f"{ENV_PREFIX}CONFIG"
_MAX_PORT = 65535
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting that cannot be used; the message names where it came from."""


@dataclass(frozen=True, slots=True)
class Option:
    """One setting of ``kvservice serve``."""

    name: str
    kind: type
    help: str
    # The ServerConfig field it sets; None for settings outside it (log_level,
    # event_loop).
    field: str | None = None
    choices: tuple[str, ...] | None = None
    # Other flags for the same setting: vLLM's names, so a vLLM command line's cache
    # flags work unchanged.
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "gRPC bind address", "host"),
    Option("port", int, "gRPC port (0: any free port)", "port"),
    Option(
        "unix_socket",
        str,
        "also serve gRPC on this Unix domain socket path, for an engine on the same node "
        "(its target: unix:PATH; a stale socket file is replaced)",
        "unix_socket",
    ),
    Option(
        "step_socket",
        str,
        "also serve StepStream on this Unix domain socket path without gRPC (framed "
        "messages, mode 0600), for an engine on the same node: its KVSERVICE_STEP_SOCKET",
        "step_socket",
    ),
    Option(
        "metrics",
        bool,
        "serve HTTP /metrics (Prometheus), /health and /ready on metrics_host:metrics_port",
    ),
    Option("metrics_host", str, "HTTP /metrics, /health and /ready bind address", "metrics_host"),
    Option("metrics_port", int, "HTTP metrics port (0: any free port)", "metrics_port"),
    Option(
        "num_blocks",
        int,
        "KV cache blocks in the pool, null block included",
        "num_blocks",
        aliases=("--num-gpu-blocks-override",),
    ),
    Option("block_size", int, "tokens per block", "block_size"),
    Option("max_model_len", int, "the longest sequence, in tokens", "max_model_len"),
    Option(
        "vocab_size",
        int,
        "token ids must be below this; AddRequest and AppendTokens refuse others "
        "INVALID_ARGUMENT (0: no upper bound, only negative ids are refused)",
        "vocab_size",
    ),
    Option("num_layers", int, "attention layers (reported only)", "num_layers"),
    Option("num_kv_heads", int, "KV heads per layer (reported only)", "num_kv_heads"),
    Option("head_size", int, "head dimension (reported only)", "head_size"),
    Option("dtype", str, "KV element type as torch names it (reported only)", "dtype"),
    Option(
        "hash_algo",
        str,
        "prefix cache block hash",
        "hash_algo",
        choices=tuple(sorted(HASH_FUNCTIONS)),
        aliases=("--prefix-caching-hash-algo",),
    ),
    Option(
        "none_hash_seed",
        str,
        "prefix hash chain seed; without it PYTHONHASHSEED sets the seed when set (as "
        "in vLLM), else sha256 variants use vLLM's fixed seed and xxhash a random one "
        "(set this or PYTHONHASHSEED to share an xxhash cache across processes)",
        "none_hash_seed",
    ),
    Option(
        "hash_block_size",
        int,
        "tokens per prefix-cache hash (0: block_size); smaller than a Mamba 'align' "
        "block it enables partial-block prefix hits with copy-on-write copies",
        "hash_block_size",
    ),
    Option(
        "mamba_block_size",
        int,
        "add a Mamba state group (mamba_cache_mode 'align') of this block size beside "
        "the attention layers, a hybrid model (0: none)",
        "mamba_block_size",
    ),
    Option(
        "sliding_window",
        int,
        "add a sliding-window attention group of this window (in tokens, same block "
        "size) beside the full-attention layers, as vLLM groups Gemma-style models "
        "(0: none)",
        "sliding_window",
    ),
    Option(
        "kv_cache_groups",
        str,
        "the KV cache groups as vLLM lays them out, comma separated, instead of full "
        "attention plus --sliding-window/--mamba-block-size: full_attention, "
        "sliding_window:W, chunked_local_attention:C, mamba:B (a Mistral-style model: "
        "sliding_window:4096); the vLLM integration names the value its engine needs",
        "kv_cache_groups",
    ),
    Option(
        "prefix_cache_retention_interval",
        int,
        "vLLM's --prefix-cache-retention-interval: 0 (vLLM's default) caches, of the "
        "sliding-window and Mamba groups' blocks, only those a replay or a shared-prefix "
        "junction needs; k > 0 also one window every k tokens. Unset: every reusable "
        "block is cached. A vLLM engine with window or Mamba layers needs vLLM's value",
        "prefix_cache_retention_interval",
    ),
    Option(
        "enable_caching",
        bool,
        "prefix caching",
        "enable_caching",
        aliases=("--enable-prefix-caching",),
    ),
    Option(
        "use_eagle",
        bool,
        "the engines draft with EAGLE (vLLM's speculative method eagle, eagle3 or mtp): "
        "a prefix hit drops its last block, as vLLM's manager does; a vLLM engine "
        "drafting with EAGLE needs it, and one that does not must not have it",
        "use_eagle",
    ),
    Option(
        "trust_client_block_hashes",
        bool,
        "take the block hashes clients send with client_hashed requests instead of "
        "hashing their tokens (vLLM has hashed them already): for a server without a "
        "tokens file, whose callers are all one party; with one, set "
        "trust_client_block_hashes per tenant in the file instead",
        "trust_client_block_hashes",
    ),
    Option(
        "max_num_encoder_input_tokens",
        int,
        "vLLM's --max-num-encoder-input-tokens: the encoder input a cross_attention group "
        "is sized for in the pool's memory check (0: --max-model-len)",
        "max_num_encoder_input_tokens",
    ),
    Option(
        "eagle_groups",
        str,
        "with --use-eagle: the KV cache groups the drafter reads, comma separated indices "
        "(vLLM marks the groups holding draft layers; the engine's startup check names "
        "them); empty: every group",
        "eagle_groups",
    ),
    Option(
        "num_hash_lookahead_tokens",
        int,
        "vLLM 0.33's lookahead block hashes: each block's hash also covers this many "
        "tokens after it (an EAGLE drafter's default is 1; vLLM's "
        "num_hash_lookahead_tokens). A vLLM engine's must match (0: none)",
        "num_hash_lookahead_tokens",
    ),
    Option(
        "eviction_policy",
        str,
        "which free cached blocks are evicted first: lru (vLLM's order) or priority "
        "(AddRequest's retention priorities reorder them, lowest first; see README, "
        "Retention)",
        "eviction_policy",
        choices=("lru", "priority"),
    ),
    Option(
        "max_pinned_fraction",
        float,
        "fraction of the pool pinned prefixes may reserve (PinPrefix, AddRequest's "
        "cache_control_ttl); pinned blocks stay cached and count as used (0: pinning "
        "off)",
        "max_pinned_fraction",
    ),
    Option(
        "watermark",
        float,
        "fraction of the pool kept free when admitting waiting or preempted requests "
        "while others run (vLLM's --watermark)",
        "watermark",
    ),
    Option(
        "max_in_flight_tokens",
        int,
        "tokens one engine step may schedule before it has run: vLLM's "
        "max_num_batched_tokens, twice it with async scheduling; a sliding-window group "
        "is counted for at most its window plus this when admitting a request "
        "(full_sequence_must_fit), as in vLLM (0: --max-num-batched-tokens when given, "
        "else max_model_len)",
        "max_in_flight_tokens",
    ),
    Option(
        "max_num_batched_tokens",
        int,
        "vLLM's --max-num-batched-tokens: the tokens in flight when --max-in-flight-tokens "
        "is not given (one batch, vLLM's synchronous scheduling), which a window-bounded "
        "group's pool check and admission count as vLLM's do (0: not given)",
        "max_num_batched_tokens",
    ),
    Option(
        "zero_new_blocks",
        bool,
        "report freshly allocated blocks for the runtime to zero",
        "needs_kv_cache_zeroing",
    ),
    Option("model_name", str, "the model_name label of every metric", "model_name"),
    Option("engine", str, "the engine label of every metric", "engine"),
    Option(
        "shutdown_grace",
        float,
        "seconds the calls and streams already running get to finish on SIGTERM/SIGINT "
        "(new calls are refused UNAVAILABLE meanwhile)",
        "shutdown_grace_s",
    ),
    Option("max_message_bytes", int, "largest gRPC message accepted", "max_message_bytes"),
    Option("max_step_ops", int, "most operations one Step message may carry", "max_step_ops"),
    Option(
        "runtime",
        str,
        "who owns the KV tensors: none (a remote worker; answers list the blocks it must "
        "zero) or torch (this process allocates them and zeroes fresh blocks before "
        "answering; needs pip install 'kvservice[runtime]')",
        "runtime",
        choices=RUNTIMES,
    ),
    Option("device", str, "device of the runtime's KV tensors", "device", choices=DEVICES),
    Option(
        "kv_cache_memory_bytes",
        int,
        "size the pool from this many bytes of KV cache instead of num_blocks (0: use "
        "num_blocks); on CUDA it must fit in the free device memory",
        "kv_cache_memory_bytes",
    ),
    Option(
        "gpu_memory_utilization",
        float,
        "--runtime torch --device cuda: size the pool so that the device's used memory "
        "ends at this fraction of its total, measured at startup (0: use num_blocks)",
        "gpu_memory_utilization",
    ),
    Option(
        "kv_events",
        bool,
        "record the prefix cache's KV events (vLLM's BlockStored / BlockRemoved / "
        "AllBlocksCleared) and serve them over the SubscribeEvents RPC",
        "kv_events",
    ),
    Option(
        "kv_events_buffer_size",
        int,
        "recent KV events kept so a resubscribing client gets only what it missed",
        "kv_events_buffer_size",
    ),
    Option(
        "kv_events_queue_size",
        int,
        "KV events one subscriber may fall behind by before it is dropped (RESOURCE_EXHAUSTED)",
        "kv_events_queue_size",
    ),
    Option(
        "kv_events_config",
        str,
        "vLLM's --kv-events-config JSON (enable_kv_cache_events, publisher, endpoint, "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic): publish the KV events "
        "on ZMQ in vLLM's wire format for KV-aware routers (see README, KV events)",
        "kv_events_config",
    ),
    Option(
        "kv_events_bind_host",
        str,
        "the address a '*' in a bound ZMQ KV event endpoint binds (0.0.0.0: every "
        "interface; off loopback it needs --allow-insecure-bind: the stream is plaintext "
        "and carries every tenant's hashes and tokens)",
        "kv_events_bind_host",
    ),
    Option(
        "kv_events_int_block_hashes",
        bool,
        "ZMQ KV events carry block hashes as vLLM's default 64-bit ints "
        "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); false: the full hash bytes",
        "kv_events_int_block_hashes",
    ),
    Option(
        "session_ttl_min",
        float,
        "shortest session lease (seconds) OpenSession accepts",
        "session_ttl_min_s",
    ),
    Option(
        "session_ttl_max",
        float,
        "longest session lease (seconds) OpenSession accepts",
        "session_ttl_max_s",
    ),
    Option(
        "session_ttl_default",
        float,
        "session lease (seconds) granted when OpenSession asks for 0",
        "session_ttl_default_s",
    ),
    Option(
        "require_sessions",
        bool,
        "refuse mutating calls that carry no session (x-kvservice-session metadata)",
        "require_sessions",
    ),
    Option(
        "max_sessions_per_tenant",
        int,
        "most sessions one tenant may have open; OpenSession past it is refused "
        "RESOURCE_EXHAUSTED (without a tokens file every caller is one tenant)",
        "max_sessions_per_tenant",
    ),
    Option(
        "max_sessions",
        int,
        "most sessions open on the server, all tenants together; OpenSession past it is "
        "refused RESOURCE_EXHAUSTED",
        "max_sessions",
    ),
    Option(
        "max_step_streams_per_tenant",
        int,
        "most StepStreams one tenant may have open at once; a stream past it is refused "
        "RESOURCE_EXHAUSTED",
        "max_step_streams_per_tenant",
    ),
    Option(
        "max_step_streams",
        int,
        "most StepStreams open at once on the server, all tenants together; a stream past "
        "it is refused RESOURCE_EXHAUSTED",
        "max_step_streams",
    ),
    Option(
        "audit_interval",
        float,
        "seconds between the pool's invariant self-checks (0 disables them)",
        "audit_interval_s",
    ),
    Option(
        "gc_full_collection_interval",
        float,
        "seconds between the garbage collector's full collections, run by the server "
        "between calls rather than by Python wherever an allocation tips them (a pause "
        "of tens of milliseconds per 10,000 requests held, inside a Step); 0 leaves them "
        "to Python",
        "gc_full_collection_interval_s",
    ),
    Option(
        "loop_stall_interval",
        float,
        "seconds between the event-loop stall watch's wakes: the resolution of "
        "kvservice_event_loop_stall_seconds, at a wake of the server each; 0 turns the "
        "watch off",
        "loop_stall_interval_s",
    ),
    Option(
        "idempotency_cache_size",
        int,
        "operation ids remembered for idempotent retries (x-kvservice-operation-id)",
        "idempotency_cache_size",
    ),
    Option("tls_cert_file", str, "PEM server certificate chain: serve TLS", "tls_cert_file"),
    Option("tls_key_file", str, "PEM private key of tls_cert_file", "tls_key_file"),
    Option(
        "tls_client_ca_file",
        str,
        "PEM CA bundle: turns on mutual TLS (clients must present a certificate it signed)",
        "tls_client_ca_file",
    ),
    Option(
        "auth_tokens_file",
        str,
        "TOML file of tenants ([tenants.NAME] tokens, max_blocks, rate_limit, burst, "
        "admin): every call needs 'authorization: Bearer TOKEN' (see README, Security)",
        "auth_tokens_file",
    ),
    Option(
        "allow_insecure_bind",
        bool,
        "allow a non-loopback host without TLS plus tokens or mTLS (logs a warning)",
        "allow_insecure_bind",
    ),
    Option(
        "max_request_id_length",
        int,
        "longest request id AddRequest accepts, in characters (INVALID_ARGUMENT past it)",
        "max_request_id_length",
    ),
    Option(
        "max_cache_salt_length",
        int,
        "longest cache_salt AddRequest accepts, in characters",
        "max_cache_salt_length",
    ),
    Option(
        "max_lora_name_length",
        int,
        "longest lora_name AddRequest accepts, in characters",
        "max_lora_name_length",
    ),
    Option(
        "max_lora_path_length",
        int,
        "longest lora_path AddRequest accepts, in characters",
        "max_lora_path_length",
    ),
    Option(
        "max_mm_identifier_length",
        int,
        "longest multimodal item identifier AddRequest accepts, in characters",
        "max_mm_identifier_length",
    ),
    Option(
        "max_mm_items_per_prompt",
        int,
        "most multimodal items one prompt may carry (vLLM's limit_mm_per_prompt, all "
        "modalities together)",
        "max_mm_items_per_prompt",
    ),
    Option(
        "max_requests_per_tenant",
        int,
        "most requests (waiting, running or preempted) one tenant may hold; "
        "RESOURCE_EXHAUSTED past it (without a tokens file every caller is one tenant)",
        "max_requests_per_tenant",
    ),
    Option(
        "max_waiting_tokens_per_tenant",
        int,
        "most tokens one tenant's requests that are not running (waiting or preempted) "
        "may hold; they hold no blocks, so this bounds their memory (about 40 bytes a "
        "token)",
        "max_waiting_tokens_per_tenant",
    ),
    Option(
        "max_prompt_embeds_bytes_per_tenant",
        int,
        "most bytes of prompt embeddings one tenant's requests may hold (a request keeps "
        "them until it finishes); RESOURCE_EXHAUSTED past it",
        "max_prompt_embeds_bytes_per_tenant",
    ),
    Option(
        "max_mm_items_per_tenant",
        int,
        "most multimodal items one tenant's requests may hold, all prompts together (a "
        "request keeps them until it finishes); RESOURCE_EXHAUSTED past it",
        "max_mm_items_per_tenant",
    ),
    Option(
        "max_mm_identifier_bytes_per_tenant",
        int,
        "most bytes (UTF-8) of multimodal item identifiers one tenant's requests may hold, "
        "all prompts together; RESOURCE_EXHAUSTED past it",
        "max_mm_identifier_bytes_per_tenant",
    ),
    Option("log_level", str, "log level", choices=LOG_LEVELS),
    Option(
        "event_loop",
        str,
        "the asyncio event loop: uvloop (faster, the default when installed: "
        "pip install 'kvservice[uvloop]') or the standard library's",
        choices=EVENT_LOOPS,
    ),
)
_BY_NAME = {o.name: o for o in OPTIONS}
_DEFAULTS: dict[str, Any] = {
    **{o.name: getattr(ServerConfig(), o.field) for o in OPTIONS if o.field is not None},
    # ServerConfig spells "no budget" None; every settings surface spells it 0.
    "kv_cache_memory_bytes": 0,
    "gpu_memory_utilization": 0.0,
    # Off: vLLM's KVEventsConfig defaults.
    "kv_events_config": "",
    "metrics": True,
    "log_level": "info",
    "event_loop": default_event_loop(),
}


@dataclass(frozen=True, slots=True)
class Settings:
    """What ``kvservice serve`` runs with."""

    server: ServerConfig
    log_level: str
    event_loop: str = "asyncio"


def default_of(option: Option) -> Any:
    return _DEFAULTS[option.name]


def load_settings(
    flags: Mapping[str, Any], env: Mapping[str, str], config_path: Path | None = None
) -> Settings:
    """Merge the sources, highest first: ``flags`` (only those given, the others None),
    ``env`` (``KVSERVICE_*``), the TOML file at ``config_path`` (else
    ``KVSERVICE_CONFIG``), then the defaults. Raises ``SettingsError``."""
    values = dict(_DEFAULTS)
    path = config_path or (Path(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else None)
    if path is not None:
        values.update(_from_file(path))
    values.update(_from_env(env))
    values.update({k: v for k, v in flags.items() if k in _BY_NAME and v is not None})
    for option in OPTIONS:
        if option.choices and values[option.name] not in option.choices:
            raise SettingsError(
                f"{option.name} must be one of {', '.join(option.choices)}, "
                f"got {values[option.name]!r}"
            )
    for name in ("port", "metrics_port"):
        if not 0 <= values[name] <= _MAX_PORT:
            raise SettingsError(f"{name} must be between 0 and {_MAX_PORT}, got {values[name]}")
    return _settings(values)


def _settings(values: dict[str, Any]) -> Settings:
    fields = {o.field: values[o.name] for o in OPTIONS if o.field is not None}
    # Port 0 is any free port, as for gRPC; ServerConfig spells "no endpoint" None.
    if not values["metrics"]:
        fields["metrics_port"] = None
    fields["kv_cache_memory_bytes"] = fields["kv_cache_memory_bytes"] or None
    fields["gpu_memory_utilization"] = fields["gpu_memory_utilization"] or None
    for path in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
        # An empty value (KVSERVICE_TLS_CERT_FILE=) means unset, as for the others.
        fields[path] = fields[path] or None
    try:
        fields["kv_events_config"] = parse_kv_events_config(fields["kv_events_config"])
    except KVEventsConfigError as err:
        raise SettingsError(f"kv_events_config: {err}") from None
    return Settings(
        dataclasses.replace(ServerConfig(), **fields), values["log_level"], values["event_loop"]
    )


def _from_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except OSError as err:
        raise SettingsError(f"config file {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"config file {path}: {err}") from None
    values: dict[str, Any] = {}
    for key, value in table.items():
        option = _BY_NAME.get(key)
        if option is None:
            raise SettingsError(
                f"config file {path}: unknown key {key!r} (known: {', '.join(_BY_NAME)})"
            )
        values[key] = _checked(option, value, f"config file {path}: {key}")
    return values


def _checked(option: Option, value: Any, where: str) -> Any:
    # TOML has its own types; only widen int to float.
    if option.kind is float and type(value) is int:
        return float(value)
    if type(value) is not option.kind:
        raise SettingsError(f"{where}: expected {option.kind.__name__}, got {value!r}")
    return value


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw = env.get(option.env)
        if raw is not None:
            values[option.name] = parse_text(option, raw, option.env)
    return values


def parse_text(option: Option, raw: str, where: str) -> Any:
    """A value given as text (environment variable or flag)."""
    if option.kind is bool:
        lowered = raw.strip().lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise SettingsError(f"{where}: expected true/false (or 1/0, yes/no, on/off), got {raw!r}")
    try:
        return option.kind(raw)
    except ValueError:
        raise SettingsError(f"{where}: expected {option.kind.__name__}, got {raw!r}") from None
