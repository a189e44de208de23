"""An engine's CPU offload tier index served by a kvservice server (``OffloadStep``),
with a replica in the engine that answers at once.

vLLM's offloading connector asks its manager where chunks are many times a step and
acts on each answer before the next question, so a round trip per question is out of
the question. The engine keeps a replica of the index (the same ``OffloadIndex``,
started empty, as the server's): the manager (``integrations.vllm.offloading``) runs
every call on it and tells this link what the call was and what the replica answered;
once a step (``flush``, at vLLM's ``on_schedule_end``) the link sends them as one
``OffloadStep``, and the server runs them on its own index and checks every answer.
Lookups change nothing and never travel: one round trip per step, however many
requests look up.

The step is checked when the next one is sent (or at ``confirm``), so the round trip
overlaps the forward pass. The server decides: a refused step, a different answer or
a lost server raises ``OffloadLinkError`` (naming the server and the operation), and
the link refuses every call after that: the engine must stop. The index lives in the
link's own session on the server and goes with it (the lease runs out when the
engine dies).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import NoReturn

from kvservice.client.errors import KVServiceError
from kvservice.client.sync import KVClient, Lease, StartedOffloadStep
from kvservice.protocol.gen import kv_cache_service_pb2 as pb

# A key's position when the request does not know it.
UNKNOWN_POSITION = -1


class OffloadLinkError(RuntimeError):
    """The server refused a step of the offload tier, answered otherwise than the
    engine's replica, or could not be reached: the engine must stop."""


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadTierConfig:
    """The index the server builds for this engine (``OffloadTierConfig`` in the proto):
    the replica's own settings."""

    num_chunks: int
    eviction_policy: str
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    enable_events: bool = False
    # Priority policy only: the chunks pins may hold together.
    max_pinned_chunks: int = 0
    # Bytes of one chunk in the engine's host buffer (the server's byte counters).
    bytes_per_chunk: int = 0

    def to_pb(self) -> pb.OffloadTierConfig:
        # The fields are the proto's, name for name.
        return pb.OffloadTierConfig(**dataclasses.asdict(self))


class OffloadLink:
    """Records the replica's calls (one method per index call, with its answer), sends
    them once per step (``flush``) and checks the server's verdict (see the module
    docstring). ``client`` must have an open session (``open``)."""

    def __init__(self, client: KVClient, lease: Lease, config: OffloadTierConfig) -> None:
        self._client = client
        self._lease = lease
        self._config = config.to_pb()
        self._ops: list[pb.OffloadOperation] = []
        # The step sent last and not checked yet: (the call, its number of operations).
        self._unconfirmed: tuple[StartedOffloadStep, int] | None = None
        self._failure: OffloadLinkError | None = None
        self.round_trips = 0

    @classmethod
    def open(
        cls, client: KVClient, config: OffloadTierConfig, session_ttl_s: float, name: str
    ) -> OffloadLink:
        """A link on a new session of ``client`` (its lease renewed in the background)."""
        lease = client.open_session(session_ttl_s, client_name=name)
        return cls(client, lease, config)

    @property
    def target(self) -> str:
        return self._client.target

    @property
    def session_id(self) -> str:
        """The server session the index lives in."""
        return self._lease.session_id

    # -- recording ----------------------------------------------------------------------

    def _record(self, **op: object) -> None:
        self.check_alive()
        self._ops.append(pb.OffloadOperation(**op))  # type: ignore[arg-type]

    def new_request(self, request_id: str, priority: int) -> None:
        self._record(new_request=pb.OffloadNewRequest(request_id=request_id, priority=priority))

    def prepare_load(
        self,
        request_id: str,
        keys: Sequence[bytes],
        positions: Sequence[int],
        chunk_ids: Sequence[int],
    ) -> None:
        """The replica held ``keys`` (at ``positions`` in the request, one each or none;
        ``UNKNOWN_POSITION`` for unknown) for reading, in ``chunk_ids``."""
        self._record(
            prepare_load=pb.OffloadPrepareLoad(
                request_id=request_id, keys=keys, positions=positions, chunk_ids=chunk_ids
            )
        )

    def prepare_store(
        self,
        request_id: str,
        keys: Sequence[bytes],
        positions: Sequence[int],
        plan: tuple[Sequence[bytes], Sequence[int], Sequence[bytes]] | None,
    ) -> None:
        """The replica's answer to the offer of ``keys``: ``plan`` (keys to store, their
        chunk ids, keys evicted), or None for no room."""
        op = pb.OffloadPrepareStore(request_id=request_id, keys=keys, positions=positions)
        if plan is None:
            op.no_room = True
        else:
            keys_to_store, chunk_ids, evicted_keys = plan
            op.keys_to_store.extend(keys_to_store)
            op.chunk_ids.extend(chunk_ids)
            op.evicted_keys.extend(evicted_keys)
        self._record(prepare_store=op)

    def touch(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._record(touch=pb.OffloadKeys(keys=keys))

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self._record(complete_load=pb.OffloadKeys(keys=keys))

    def complete_store(self, keys: Sequence[bytes], success: bool) -> None:
        self._record(complete_store=pb.OffloadCompleteStore(keys=keys, success=success))

    def request_finished(self, request_id: str, keys: Sequence[bytes]) -> None:
        self._record(request_finished=pb.OffloadRequestFinished(request_id=request_id, keys=keys))

    def pin(
        self, pin_id: str, keys: Sequence[bytes], ttl_s: float | None, now: float, refused: bool
    ) -> None:
        self._record(
            pin=pb.OffloadPin(
                pin_id=pin_id, keys=keys, ttl_seconds=ttl_s or 0.0, now_seconds=now, refused=refused
            )
        )

    def unpin(self, pin_id: str, removed: bool) -> None:
        self._record(unpin=pb.OffloadUnpin(pin_id=pin_id, removed=removed))

    def expire_pins(self, now: float, num_expired: int) -> None:
        self._record(expire_pins=pb.OffloadExpirePins(now_seconds=now, num_expired=num_expired))

    def reset(self) -> None:
        self._record(reset=pb.OffloadReset())

    # -- sending ------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self._failure is not None:
            raise OffloadLinkError(
                f"the offload tier's index stopped after an earlier failure: {self._failure}"
            )

    def flush(self) -> None:
        """Check the last step sent, then send what was recorded since (nothing
        recorded: nothing sent)."""
        self.confirm()
        if not self._ops:
            return
        request = pb.OffloadStepRequest(config=self._config, ops=self._ops)
        self._ops = []
        self.round_trips += 1
        self._unconfirmed = (self._client.start_offload_step(request), len(request.ops))

    def confirm(self) -> None:
        """Wait for the last step sent and check the server's verdict."""
        self.check_alive()
        if self._unconfirmed is None:
            return
        sent, num_ops = self._unconfirmed
        self._unconfirmed = None
        try:
            sent.result()
        except KVServiceError as error:
            self._fail(
                f"kvservice at {self.target}: OffloadStep of {num_ops} operations failed: {error}",
                error,
            )

    def _fail(self, message: str, cause: BaseException) -> NoReturn:
        self._failure = OffloadLinkError(message)
        raise self._failure from cause

    def close(self) -> None:
        """Send and check what is left, then end the session (the server drops the
        index) and the connection."""
        try:
            if self._failure is None:
                self.flush()
                self.confirm()
        finally:
            # A server gone cannot be told: the lease runs out there.
            with contextlib.suppress(KVServiceError):
                self._lease.close()
            self._client.close()
