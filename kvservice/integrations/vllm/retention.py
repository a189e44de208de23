"""Retention per vLLM request, read from ``SamplingParams.extra_args``.

vLLM's OpenAI server fills ``extra_args`` from a request's ``vllm_xargs``, whose values
are flat (strings, numbers, lists of them), so the keys are flat too:

- ``kvservice_priority``: 0-100, the priority of every prompt block;
  ``kvservice_priority_duration``: seconds or ``"5m"``, after which the default (35)
  holds again;
- ``kvservice_priority_ranges``: ``["start:end:priority[:duration]", ...]`` (an empty
  ``end``: to the prompt's end);
- ``kvservice_decode_priority`` and ``kvservice_decode_priority_duration``: the same
  for the blocks decoding fills;
- ``cache_control``: Dynamo's ``{"type": "ephemeral", "ttl": "5m"}`` (or just
  ``"5m"``): pin the prompt's whole blocks for the TTL.

Priorities need ``KVSERVICE_EVICTION_POLICY=priority``, pins ``KVSERVICE_MAX_PINNED_FRACTION``
(both read by ``KVServiceKVCacheManager`` in-process). A request whose retention cannot be
used is served without it and logged: one malformed request never stops the engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvservice.core.errors import InvalidArgumentError
from kvservice.core.kv_cache_block import DEFAULT_PRIORITY
from kvservice.core.retention_policy import (
    EVICTION_POLICIES,
    RetentionConfig,
    TokenRangeRetention,
    parse_duration,
)

# The tenant pins from vLLM requests are filed under.
PIN_TENANT = "vllm"


@dataclass(frozen=True, slots=True)
class RetentionSettings:
    """The in-process pool's policy, from ``KVSERVICE_EVICTION_POLICY`` (``lru``, the
    default, or ``priority``) and ``KVSERVICE_MAX_PINNED_FRACTION`` (0: no pins)."""

    eviction_policy: str = "lru"
    max_pinned_fraction: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.eviction_policy != "lru" or self.max_pinned_fraction > 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RetentionSettings:
        env = os.environ if env is None else env
        policy = env.get("KVSERVICE_EVICTION_POLICY") or "lru"
        if policy not in EVICTION_POLICIES:
            raise ValueError(
                f"KVSERVICE_EVICTION_POLICY={policy!r}: use one of {list(EVICTION_POLICIES)}"
            )
        raw = env.get("KVSERVICE_MAX_PINNED_FRACTION") or "0"
        try:
            fraction = float(raw)
        except ValueError:
            raise ValueError(f"KVSERVICE_MAX_PINNED_FRACTION={raw!r} is not a number") from None
        if not 0 <= fraction < 1:
            raise ValueError(f"KVSERVICE_MAX_PINNED_FRACTION={raw!r} must be in [0, 1)")
        return cls(policy, fraction)


@dataclass(frozen=True, slots=True)
class RequestRetention:
    """What one request asks for: block priorities, and a pin of its prompt."""

    config: RetentionConfig | None = None
    pin_ttl_s: float | None = None


NO_RETENTION = RequestRetention()


def request_retention(extra_args: Mapping[str, Any] | None) -> RequestRetention:
    """The retention ``extra_args`` asks for; InvalidArgumentError names a bad key."""
    if not extra_args:
        return NO_RETENTION
    ranges = [_range(text) for text in _as_list(extra_args.get("kvservice_priority_ranges"))]
    if "kvservice_priority" in extra_args:
        duration = _duration(extra_args, "kvservice_priority_duration")
        priority = _int(extra_args["kvservice_priority"], "kvservice_priority")
        ranges.insert(0, TokenRangeRetention(0, None, priority, duration))
    has_decode = "kvservice_decode_priority" in extra_args
    config = None
    if ranges or has_decode:
        config = RetentionConfig(
            tuple(ranges),
            _int(extra_args["kvservice_decode_priority"], "kvservice_decode_priority")
            if has_decode
            else DEFAULT_PRIORITY,
            _duration(extra_args, "kvservice_decode_priority_duration"),
        )
    return RequestRetention(config, _pin_ttl(extra_args.get("cache_control")))


def _pin_ttl(cache_control: Any) -> float | None:
    if cache_control is None:
        return None
    if isinstance(cache_control, Mapping):
        if cache_control.get("type", "ephemeral") != "ephemeral":
            raise InvalidArgumentError(
                f"cache_control: type {cache_control.get('type')!r} is unknown; use 'ephemeral'"
            )
        ttl = cache_control.get("ttl")
        if ttl is None:
            raise InvalidArgumentError("cache_control needs a ttl, e.g. {'ttl': '5m'}")
        return parse_duration(ttl, "cache_control ttl")
    return parse_duration(cache_control, "cache_control")


def _range(text: Any) -> TokenRangeRetention:
    parts = str(text).split(":")
    if len(parts) not in (3, 4):
        raise InvalidArgumentError(
            f"kvservice_priority_ranges: {text!r} is not 'start:end:priority[:duration]'"
        )
    what = f"kvservice_priority_ranges {text!r}"
    start = _int(parts[0], what)
    end = _int(parts[1], what) if parts[1] else None
    duration = parse_duration(parts[3], what) if len(parts) == 4 and parts[3] else None
    return TokenRangeRetention(start, end, _int(parts[2], what), duration)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _int(value: Any, what: str) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise InvalidArgumentError(f"{what}: {value!r} is not a whole number") from None
    return number


def _duration(extra_args: Mapping[str, Any], key: str) -> float | None:
    value = extra_args.get(key)
    return None if value is None else parse_duration(value, key)
