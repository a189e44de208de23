"""Server settings and the embedded default pool (no GPU, no config file needed)."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvservice.core.block_hashing import CRYPTOGRAPHIC_HASHES
from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_groups import GroupShape, group_spec, parse_groups
from kvservice.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecKind,
    SlidingWindowSpec,
)
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.kv_cache_sizing import check_enough_kv_cache_memory, kv_cache_config_from_memory
from kvservice.request_table.limits import RequestLimits
from kvservice.server.loop_watch import STALL_INTERVAL_S
from kvservice.server.zmq_events.config import KVEventsConfig

_LIMITS = RequestLimits()

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9400


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything needed to start one server owning one pool.

    The pool defaults to a single full-attention group shaped like an 8-KV-head,
    128-dim, bfloat16 model with 32 layers; only ``num_blocks``, ``block_size`` and
    ``max_model_len`` change what the request table does, the rest is reported.

    ``port=0`` binds a free port, and so does ``metrics_port=0``; ``metrics_port=None``
    disables the HTTP endpoint (metrics, health and readiness; the CLI's
    ``--no-metrics``).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # Also serve gRPC on this Unix domain socket (clients' target ``unix:PATH``): a
    # co-located engine skips the TCP stack. "": none.
    unix_socket: str = ""
    # Also serve StepStream on this Unix domain socket without gRPC (``step_socket``):
    # length-prefixed frames, the same interceptors and handler. "": none.
    step_socket: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = DEFAULT_METRICS_PORT
    num_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 8192
    # Token ids must be below this; 0: no upper bound (only negative ids are refused).
    vocab_size: int = 0
    num_layers: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    hash_algo: str = "sha256"
    none_hash_seed: str | None = None
    # Tokens per prefix-cache hash; 0: ``block_size``. It must divide every block size.
    hash_block_size: int = 0
    # A Mamba state group (mode "align", one layer, page padded to the attention page)
    # of this block size beside the attention group; 0: none. With a hash block below
    # its block size, prefix hits may end inside a block (copy-on-write copies).
    mamba_block_size: int = 0
    # A sliding-window attention group of this window (tokens) and the attention
    # block size beside the full-attention group; 0: none.
    sliding_window: int = 0
    # The groups as vLLM lays them out (``kvservice.core.kv_cache_groups``: e.g.
    # "sliding_window:4096" for a model with a window on every layer), instead of the
    # full-attention group and the two options above; "": those.
    kv_cache_groups: str = ""
    # vLLM's prefix_cache_retention_interval: 0 (vLLM's default) caches, of the window
    # and Mamba groups' blocks, only those a replay or a shared-prefix junction needs;
    # None: every reusable block (dense). A vLLM engine's must match.
    prefix_cache_retention_interval: int | None = None
    enable_caching: bool = True
    # The engine drafts with EAGLE (vLLM's use_eagle): a prefix hit drops its last
    # block, whose draft KV depends on the token after it, as vLLM's manager does. A
    # pool's hits are every engine's, so this is the pool's; a vLLM engine's must match.
    use_eagle: bool = False
    # The groups the EAGLE drafter reads (vLLM marks those holding draft layers,
    # ``is_eagle_group``), comma separated indices; "": every group.
    eagle_groups: str = ""
    # vLLM 0.33's lookahead block hashes (an EAGLE drafter's default: 1): each block's
    # hash also covers this many tokens after it. The server hashes requests itself, so
    # a vLLM engine's must match.
    num_hash_lookahead_tokens: int = 0
    # Take the block hashes of client_hashed requests instead of hashing them (a server
    # without a tokens file: every caller is the default tenant; with one, each
    # tenant's trust_client_block_hashes decides). ``request_table.client_hashes``.
    trust_client_block_hashes: bool = False
    # Which free cached blocks are evicted first: "lru" (vLLM's order, the default) or
    # "priority" (requests' retention priorities reorder them; README, Retention).
    eviction_policy: str = "lru"
    # The fraction of the pool pins may reserve (PinPrefix, AddRequest's
    # cache_control_ttl); 0: pinning is off.
    max_pinned_fraction: float = 0.0
    # Fraction of num_blocks kept free when admitting waiting or preempted requests
    # while others are scheduled (vLLM's --watermark).
    watermark: float = 0.0
    # Tokens one engine step may schedule before the step has run (vLLM's
    # ``max_in_flight_tokens``: max_num_batched_tokens times its concurrent batches);
    # sliding-window groups are counted for at most a window plus this at admission.
    # 0: max_num_batched_tokens when set, else max_model_len, as vLLM's manager defaults.
    max_in_flight_tokens: int = 0
    # vLLM's max_num_encoder_input_tokens: what a cross_attention group is sized for in
    # the pool's memory check; 0: max_model_len.
    max_num_encoder_input_tokens: int = 0
    # vLLM's max_num_batched_tokens: the tokens in flight when max_in_flight_tokens is
    # not set (one batch in flight, vLLM's synchronous scheduling); 0: not given.
    max_num_batched_tokens: int = 0
    needs_kv_cache_zeroing: bool = False
    model_name: str = "default"
    engine: str = "0"
    # Seconds in-flight RPCs get to finish on shutdown.
    shutdown_grace_s: float = 5.0
    max_message_bytes: int = 4 * 1024 * 1024
    # Operations one Step (or one StepStream message) may carry.
    max_step_ops: int = 4096
    # The co-located runtime (``kvservice.server.runtime``): "none" leaves the KV
    # tensors to a remote worker; "torch" allocates them on ``device`` in this process
    # and zeroes fresh blocks before answering.
    runtime: str = "none"
    device: str = "cpu"
    # A KV cache budget in bytes that sizes the pool instead of ``num_blocks``.
    kv_cache_memory_bytes: int | None = None
    # CUDA only: size the pool so that the device's used memory ends at this fraction
    # of its total (vLLM's ``gpu_memory_utilization``), from ``torch.cuda.mem_get_info``.
    gpu_memory_utilization: float | None = None
    # KV events (``SubscribeEvents``): off by default, since collecting them costs
    # time on every allocation even with nobody subscribed.
    kv_events: bool = False
    # Recent events kept for subscribers that resume from a sequence number.
    kv_events_buffer_size: int = 100_000
    # Events one subscriber may fall behind by before it is dropped.
    kv_events_queue_size: int = 10_000
    # vLLM's ``--kv-events-config``: the ZMQ stream (``zmq_events``); recording on too.
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    # The address a ``*`` in a bound ZMQ endpoint binds ("0.0.0.0": every interface).
    kv_events_bind_host: str = "127.0.0.1"
    # ZMQ block hashes as vLLM's default int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), else bytes.
    kv_events_int_block_hashes: bool = True
    # Client sessions (``sessions``): the lease bounds OpenSession accepts, the lease
    # granted for ttl_seconds = 0, and whether mutating calls need a session.
    session_ttl_min_s: float = 1.0
    session_ttl_max_s: float = 3600.0
    session_ttl_default_s: float = 30.0
    require_sessions: bool = False
    # How many sessions may be open, per tenant and in all, and how many StepStreams
    # may be open at once, per tenant and in all (``sessions``; RESOURCE_EXHAUSTED
    # past them). A session costs about 600 bytes, a stream about 30 KB.
    max_sessions_per_tenant: int = 1024
    max_sessions: int = 65_536
    max_step_streams_per_tenant: int = 256
    max_step_streams: int = 4096
    # Seconds between the pool's periodic self-checks (``audit``); 0 disables them.
    audit_interval_s: float = 60.0
    # Seconds between the garbage collector's full collections, which the server runs
    # itself in the table's turn (never inside a Step's slices) instead of Python
    # (``loop_watch.FullCollections``); 0 leaves them to Python. Process-wide.
    gc_full_collection_interval_s: float = 60.0
    # Seconds between the stall watch's wakes (``loop_watch.StallWatch``): the
    # resolution of kvservice_event_loop_stall_seconds, at a wake of the server each;
    # 0 turns the watch off.
    loop_stall_interval_s: float = STALL_INTERVAL_S
    # Operation ids remembered for idempotent retries (``idempotency``).
    idempotency_cache_size: int = 10_000
    # Security (``tls``, ``auth``): PEM files for TLS; a client CA turns on mutual TLS.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # TOML file of tenants, their bearer tokens, block quotas and rate limits; None:
    # no authentication, every caller is the default tenant.
    auth_tokens_file: str | None = None
    # Serve a non-loopback address without TLS plus client authentication.
    allow_insecure_bind: bool = False
    # What one caller may send and hold (``RequestLimits``): field lengths, multimodal
    # items per prompt, and per tenant the requests held, their waiting tokens, prompt
    # embeddings and multimodal items.
    max_request_id_length: int = _LIMITS.max_request_id_length
    max_cache_salt_length: int = _LIMITS.max_cache_salt_length
    max_lora_name_length: int = _LIMITS.max_lora_name_length
    max_lora_path_length: int = _LIMITS.max_lora_path_length
    max_mm_identifier_length: int = _LIMITS.max_mm_identifier_length
    max_mm_items_per_prompt: int = _LIMITS.max_mm_items_per_prompt
    max_requests_per_tenant: int = _LIMITS.max_requests_per_tenant
    max_waiting_tokens_per_tenant: int = _LIMITS.max_waiting_tokens_per_tenant
    max_prompt_embeds_bytes_per_tenant: int = _LIMITS.max_prompt_embeds_bytes_per_tenant
    max_mm_items_per_tenant: int = _LIMITS.max_mm_items_per_tenant
    max_mm_identifier_bytes_per_tenant: int = _LIMITS.max_mm_identifier_bytes_per_tenant

    @property
    def request_limits(self) -> RequestLimits:
        """The limits above; ``InvalidArgumentError`` for one that is not positive."""
        return RequestLimits(
            max_request_id_length=self.max_request_id_length,
            max_cache_salt_length=self.max_cache_salt_length,
            max_lora_name_length=self.max_lora_name_length,
            max_lora_path_length=self.max_lora_path_length,
            max_mm_identifier_length=self.max_mm_identifier_length,
            max_mm_items_per_prompt=self.max_mm_items_per_prompt,
            max_requests_per_tenant=self.max_requests_per_tenant,
            max_waiting_tokens_per_tenant=self.max_waiting_tokens_per_tenant,
            max_prompt_embeds_bytes_per_tenant=self.max_prompt_embeds_bytes_per_tenant,
            max_mm_items_per_tenant=self.max_mm_items_per_tenant,
            max_mm_identifier_bytes_per_tenant=self.max_mm_identifier_bytes_per_tenant,
        )

    @property
    def records_kv_events(self) -> bool:
        """Whether the pool records KV events (for SubscribeEvents, ZMQ or both)."""
        return self.kv_events or self.kv_events_config.enable_kv_cache_events

    @property
    def tokens_in_flight(self) -> int:
        """vLLM's ``max_in_flight_tokens`` for this pool: as set, else one batch of
        ``max_num_batched_tokens``, else ``max_model_len`` (vLLM's manager default)."""
        return self.max_in_flight_tokens or self.max_num_batched_tokens or self.max_model_len

    @property
    def has_runtime(self) -> bool:
        """Whether this process owns the KV tensors (``runtime`` is not "none")."""
        return self.runtime != "none"


def build_kv_cache_config(
    config: ServerConfig, available_memory: int | None = None
) -> KVCacheConfig:
    """The pool: one full-attention group of ``num_layers`` layers (beside it a
    sliding-window group and a Mamba group when configured), of ``num_blocks`` blocks,
    or of as many as ``available_memory`` bytes hold when given.

    Zeroing is on when the config asks for it and always with a runtime: the runtime
    zeroes what ``take_new_block_ids`` records, which it records only then.

    Raises ``InvalidArgumentError`` for a shape the core rejects, or a pool too small
    for one request of ``max_model_len`` tokens.
    """
    spec = FullAttentionSpec(
        block_size=config.block_size,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_size,
        dtype=config.dtype,
    )
    _check_hash_block_size(config)
    if config.kv_cache_groups:
        groups = _named_groups(config, spec)
    else:
        groups = _default_groups(config, spec)
    groups = _mark_eagle_groups(config, groups)
    if available_memory is None and config.num_blocks < 2:
        raise InvalidArgumentError(
            f"num_blocks must be at least 2 (block 0 is the null block), got {config.num_blocks}"
        )
    kv_cache_config = dataclasses.replace(
        kv_cache_config_from_memory(
            groups,
            available_memory=available_memory or 0,
            num_gpu_blocks_override=config.num_blocks if available_memory is None else None,
            needs_kv_cache_zeroing=config.needs_kv_cache_zeroing or config.has_runtime,
        ),
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
    )
    try:
        check_enough_kv_cache_memory(kv_cache_config, config.max_model_len, config.tokens_in_flight)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(_pool_too_small(config, str(err))) from None
    return kv_cache_config


def _default_groups(config: ServerConfig, spec: FullAttentionSpec) -> list[KVCacheGroupSpec]:
    """Full attention over ``num_layers`` layers, beside it the sliding-window and
    Mamba groups the options ask for."""
    layers = [f"model.layers.{i}.self_attn" for i in range(config.num_layers)]
    groups = [KVCacheGroupSpec(layers, spec)]
    if config.sliding_window:
        window = SlidingWindowSpec(
            block_size=config.block_size,
            num_kv_heads=config.num_kv_heads,
            head_size=config.head_size,
            dtype=config.dtype,
            sliding_window=config.sliding_window,
        )
        groups.append(KVCacheGroupSpec(["model.layers.sliding_window"], window))
    if config.mamba_block_size:
        mamba = GroupShape(KVCacheSpecKind.MAMBA, config.mamba_block_size)
        groups.append(
            KVCacheGroupSpec(
                ["model.layers.mamba"],
                group_spec(mamba, spec, spec.page_size_bytes, config.enable_caching),
            )
        )
    return groups


def _mark_eagle_groups(
    config: ServerConfig, groups: list[KVCacheGroupSpec]
) -> list[KVCacheGroupSpec]:
    """``groups`` with those ``--eagle-groups`` names marked as the drafter's."""
    if not config.eagle_groups:
        return groups
    if not config.use_eagle:
        raise InvalidArgumentError(
            "--eagle-groups names the EAGLE drafter's groups: add --use-eagle"
        )
    try:
        marked = {int(word) for word in config.eagle_groups.split(",")}
    except ValueError:
        raise InvalidArgumentError(
            f"--eagle-groups {config.eagle_groups!r}: write group indices, comma separated "
            f"(e.g. 0 or 0,2)"
        ) from None
    if not marked <= set(range(len(groups))):
        raise InvalidArgumentError(
            f"--eagle-groups {config.eagle_groups!r}: the pool has groups 0..{len(groups) - 1}"
        )
    return [dataclasses.replace(g, is_eagle_group=i in marked) for i, g in enumerate(groups)]


def _named_groups(config: ServerConfig, spec: FullAttentionSpec) -> list[KVCacheGroupSpec]:
    """The groups ``kv_cache_groups`` names (``num_layers`` layers each), the attention
    ones shaped as ``spec``, a Mamba state padded to its page."""
    if config.sliding_window or config.mamba_block_size:
        raise InvalidArgumentError(
            "--kv-cache-groups names every group: drop --sliding-window and "
            "--mamba-block-size (write sliding_window:W or mamba:B among the groups)"
        )
    groups = []
    for index, shape in enumerate(parse_groups(config.kv_cache_groups)):
        group = group_spec(
            shape,
            spec,
            spec.page_size_bytes,
            config.enable_caching,
            config.max_num_encoder_input_tokens or config.max_model_len,
        )
        layers = [f"model.layers.{index}.{i}" for i in range(config.num_layers)]
        groups.append(KVCacheGroupSpec(layers, group))
    return groups


def _pool_too_small(config: ServerConfig, message: str) -> str:
    """The core's message, with the flags that fix it: the core names no flag, and a
    window-bounded pool's need depends on one a newcomer does not think of."""
    advice = " Raise --num-blocks (or --kv-cache-memory-bytes) or lower --max-model-len."
    windowed = [
        shape
        for shape in _group_shapes(config)
        if shape.kind in (KVCacheSpecKind.SLIDING_WINDOW, KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION)
    ]
    if windowed:
        if config.max_in_flight_tokens:
            setting = f"--max-in-flight-tokens {config.max_in_flight_tokens}"
        elif config.max_num_batched_tokens:
            setting = f"--max-num-batched-tokens {config.max_num_batched_tokens}"
        else:
            setting = (
                "neither --max-num-batched-tokens nor --max-in-flight-tokens set: "
                f"max_model_len, {config.max_model_len}"
            )
        advice += (
            f" A window-bounded group ({', '.join(map(str, windowed))}) counts at most its "
            f"window plus the tokens in flight ({config.tokens_in_flight}; {setting}) per "
            f"request: give --max-num-batched-tokens as vLLM's (or --max-in-flight-tokens, "
            f"vLLM's max_num_batched_tokens times its concurrent batches) to need fewer blocks."
        )
    return message.replace(" Give the KV cache more memory or lower max_model_len.", "") + advice


def _group_shapes(config: ServerConfig) -> list[GroupShape]:
    """The pool's groups as ``--kv-cache-groups`` words (the options' when not given)."""
    if config.kv_cache_groups:
        return parse_groups(config.kv_cache_groups)
    shapes = [GroupShape(KVCacheSpecKind.FULL_ATTENTION)]
    if config.sliding_window:
        shapes.append(GroupShape(KVCacheSpecKind.SLIDING_WINDOW, config.sliding_window))
    if config.mamba_block_size:
        shapes.append(GroupShape(KVCacheSpecKind.MAMBA, config.mamba_block_size))
    return shapes


def _check_hash_block_size(config: ServerConfig) -> None:
    sizes = {"block_size": config.block_size}
    for shape in _group_shapes(config):
        if shape.kind is KVCacheSpecKind.MAMBA:
            sizes["mamba_block_size"] = shape.size
    for name, size in sizes.items():
        if size < 0 or (name == "block_size" and size == 0):
            raise InvalidArgumentError(f"{name} must be positive, got {size}")
    hbs = config.hash_block_size
    if hbs < 0:
        raise InvalidArgumentError(f"hash_block_size must be >= 0 (0: block_size), got {hbs}")
    for name, size in sizes.items():
        if hbs and size % hbs != 0:
            raise InvalidArgumentError(
                f"hash_block_size {hbs} must divide {name} {size}; allowed values are the "
                f"common divisors of the block sizes {sorted(set(sizes.values()))}"
            )


def build_manager(
    config: ServerConfig, kv_cache_config: KVCacheConfig | None = None
) -> KVCacheManager:
    """The manager the server owns (of ``kv_cache_config``, else the config's pool);
    stats on, so the metrics can be fed; KV events on with ``records_kv_events``."""
    return KVCacheManager(
        kv_cache_config or build_kv_cache_config(config),
        config.max_model_len,
        enable_caching=config.enable_caching,
        use_eagle=config.use_eagle,
        num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        log_stats=True,
        watermark=config.watermark,
        max_in_flight_tokens=config.tokens_in_flight,
        hash_algo=config.hash_algo,
        none_hash_seed=config.none_hash_seed,
        hash_block_size=config.hash_block_size or None,
        enable_kv_cache_events=config.records_kv_events,
        eviction_policy=config.eviction_policy,
        max_pinned_fraction=config.max_pinned_fraction,
    )


class HashSeedSource(enum.Enum):
    """Where the hash chain's seed came from, in order of precedence (vLLM's
    ``resolve_none_hash_seed``, with ``--none-hash-seed`` first)."""

    EXPLICIT = "explicit"
    PYTHONHASHSEED = "PYTHONHASHSEED"
    DEFAULT = "default"
    RANDOM = "random"

    @property
    def secret(self) -> bool:
        """Whether the seed must not leave the server: a random xxhash seed, which
        anyone knowing could use to craft colliding blocks offline."""
        return self is HashSeedSource.RANDOM


def hash_seed_source(
    config: ServerConfig, environ: Mapping[str, str] = os.environ
) -> HashSeedSource:
    """Where the seed ``build_manager`` resolves comes from (the core's
    ``resolve_none_hash_seed`` rules, read from the same environment)."""
    if config.none_hash_seed is not None:
        return HashSeedSource.EXPLICIT
    if environ.get("PYTHONHASHSEED") is not None:
        return HashSeedSource.PYTHONHASHSEED
    if config.hash_algo in CRYPTOGRAPHIC_HASHES:
        return HashSeedSource.DEFAULT
    return HashSeedSource.RANDOM
