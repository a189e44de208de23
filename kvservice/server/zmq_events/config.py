"""``--kv-events-config``: vLLM 0.33.0's ``KVEventsConfig`` keys, defaults and meaning
(``vllm/config/kv_events.py``), and where its endpoints bind or connect.

The endpoint grammar is vLLM's (``ZmqEventPublisher._is_bind_endpoint``): the PUB
endpoint is bound when it holds ``*`` or ``::`` or is ``ipc://``/``inproc://``, and
connected to otherwise (the router binds, e.g. llm-d's indexer); the replay endpoint is
always bound. One difference, for safety: ``*`` binds ``bind_host`` (the
``kv_events_bind_host`` setting, loopback by default) rather than every interface,
because the stream has neither TLS nor authentication and carries every tenant's
block hashes and token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")
SCHEMES = ("tcp://", "ipc://", "inproc://")


class KVEventsConfigError(ValueError):
    """A ``--kv-events-config`` that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``, field for field, with its defaults.

    ``enable_kv_cache_events`` makes the pool record events (as ``--kv-events`` does);
    ``publisher`` "zmq" also publishes them on ZMQ. As in vLLM, no publisher means "zmq"
    when events are enabled, else "null".
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    # Batches kept for the replay socket.
    buffer_steps: int = 10_000
    # Batches ZMQ queues per subscriber before that subscriber misses some.
    hwm: int = 100_000
    # Batches waiting between the event loop and the publishing thread.
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            publisher = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", publisher)

    @property
    def publishes(self) -> bool:
        """Whether events go out on ZMQ (vLLM publishes nothing unless enabled)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_KEYS = tuple(f.name for f in fields(KVEventsConfig))
# The least each count may be: 0 is ZMQ's "no limit" for a high-water mark, which would
# let one stalled subscriber grow the server's memory without bound.
_MINIMUM = {"buffer_steps": 0, "hwm": 1, "max_queue_size": 1}


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config a JSON object with vLLM's keys describes; empty text is the default
    (off). Raises ``KVEventsConfigError`` naming the key at fault."""
    if not text.strip():
        return KVEventsConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise KVEventsConfigError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(raw, dict):
        raise KVEventsConfigError(f"expected a JSON object of vLLM's keys, got {text!r}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise KVEventsConfigError(f"unknown keys {unknown} (known: {', '.join(_KEYS)})")
    config = KVEventsConfig(**{key: _checked(key, value) for key, value in raw.items()})
    endpoint_is_bound(config.endpoint)  # validates the grammar
    if config.replay_endpoint is not None:
        _split(config.replay_endpoint)
    return config


def _checked(key: str, value: Any) -> Any:
    default = getattr(KVEventsConfig(), key)
    if key == "publisher":
        if value is not None and value not in PUBLISHERS:
            raise KVEventsConfigError(
                f"publisher must be one of {', '.join(PUBLISHERS)}, got {value!r}"
            )
        return value
    if key == "replay_endpoint" and value is None:
        return None
    expected = str if key == "replay_endpoint" else type(default)
    if type(value) is not expected:
        raise KVEventsConfigError(f"{key}: expected {expected.__name__}, got {value!r}")
    least = _MINIMUM.get(key)
    if least is not None and int(value) < least:
        raise KVEventsConfigError(f"{key} must be at least {least}, got {value}")
    return value


def _split(endpoint: str) -> tuple[str, str, str]:
    """``(scheme, host, port)`` of a tcp endpoint, ``(scheme, path, "")`` otherwise."""
    scheme = next((s for s in SCHEMES if endpoint.startswith(s)), None)
    if scheme is None:
        raise KVEventsConfigError(f"endpoint {endpoint!r} must start with {', '.join(SCHEMES)}")
    rest = endpoint[len(scheme) :]
    if scheme != "tcp://":
        if not rest:
            raise KVEventsConfigError(f"endpoint {endpoint!r} names no path")
        return scheme, rest, ""
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise KVEventsConfigError(
            f"endpoint {endpoint!r} must be tcp://HOST:PORT (HOST * to bind, PORT 0 for a "
            f"free port)"
        )
    return scheme, host, port


def endpoint_is_bound(endpoint: str) -> bool:
    """Whether vLLM binds the PUB ``endpoint`` (else it connects to it)."""
    scheme, host, _ = _split(endpoint)
    return scheme != "tcp://" or "*" in host or "::" in host


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a socket goes: ``address`` for zmq, bound or connected to."""

    address: str
    bind: bool

    @property
    def tcp_host(self) -> str | None:
        """The host of a tcp endpoint (brackets kept), None for ipc and inproc."""
        scheme, host, _ = _split(self.address)
        return host if scheme == "tcp://" else None


def resolve(endpoint: str, bind: bool, bind_host: str) -> Endpoint:
    """The address for zmq: a bound ``*`` becomes ``bind_host`` (``*`` or ``0.0.0.0``
    for every interface)."""
    scheme, host, port = _split(endpoint)
    if scheme == "tcp://" and bind and host == "*":
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        return Endpoint(f"tcp://{host}:{port}", bind)
    return Endpoint(endpoint, bind)
