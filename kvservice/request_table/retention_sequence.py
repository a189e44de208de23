"""Retention changes held for a replica session's step boundaries.

A scheduler that keeps a replica of the pool (vLLM's integration) must see the pool
change only through its own operations, in the order it sent them. On a pool with
retention, three things would change it behind the replica's back: time (a pin's TTL
or a priority's duration running out), and pins and unpins from other callers. While a
replica session drives the pool, the server therefore decides them but holds them:
each Step answer to that session carries the changes decided since its last step (a
``Tick`` to the server's clock first, then the pins and unpins queued, in order), and
both apply them after the operations of the session's next Step message (answer k's,
after message k + 1's): the server once it ran them, before it answers; the replica
as soon as it sent it. A scheduler confirming with overlap reads answer k just before
it sends message k + 1, so it has the changes by then; and once a step's answer is
in, both sides have applied the same changes. The retention clock restarts from 0
when the session opens, as the replica's fresh pool's does.
"""

from __future__ import annotations

from typing import Final

from kvservice.core.retention_policy import RetentionEvent, Tick

# Step messages between the answer that ships an event and the one after whose
# operations it applies.
LAG: Final = 1


class RetentionSequence:
    """The replica session driving the pool (None: changes apply at once), the number
    of its Step messages so far, and the events waiting for a boundary."""

    def __init__(self) -> None:
        self.driver: str | None = None
        self.step = 0
        # Queued since the driver's last step: shipped with its next answer.
        self._queued: list[RetentionEvent] = []
        # Shipped, by the index of the step message whose boundary applies them.
        self._due: dict[int, list[RetentionEvent]] = {}

    @property
    def queued(self) -> list[RetentionEvent]:
        return self._queued

    def start(self, session_id: str) -> None:
        self.driver = session_id
        self.step = 0

    def queue(self, event: RetentionEvent) -> None:
        self._queued.append(event)

    def end_step(self, now: float) -> list[RetentionEvent]:
        """The events to ship with the answer to the driver's current step message:
        time passing to ``now``, then what was queued; due after the operations of the
        message ``LAG`` later."""
        events: list[RetentionEvent] = [Tick(now), *self._queued]
        self._queued.clear()
        self._due[self.step + LAG] = events
        return events

    def due(self) -> list[RetentionEvent]:
        """The shipped events due after the operations of the current step message."""
        ready = sorted(target for target in self._due if target <= self.step)
        return [event for target in ready for event in self._due.pop(target)]

    def stop(self) -> list[RetentionEvent]:
        """The driver is gone: everything shipped or queued, in order, to apply now."""
        events = [event for target in sorted(self._due) for event in self._due[target]]
        events += self._queued
        self._due.clear()
        self._queued.clear()
        self.driver = None
        return events
