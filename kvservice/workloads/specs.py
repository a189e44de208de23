"""``RequestSpec``: one request a workload submits to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request as a workload describes it, before any scheduling.

    ``priority`` follows vLLM: a lower value is more important. ``arrival_step`` is the
    scheduler step at which the request joins the waiting queue. ``prefix_priority``
    (0-100, None: none) keeps the prompt's first ``prefix_len`` tokens (a shared system
    prompt) at that eviction priority, on a pool with the priority eviction policy.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_output_tokens: int
    arrival_step: int = 0
    priority: int = 0
    prefix_priority: int | None = None
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        if self.max_output_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r}: max_output_tokens must be >= 1, "
                f"got {self.max_output_tokens}"
            )

    @property
    def max_total_tokens(self) -> int:
        """The longest the sequence can grow: prompt plus every output token."""
        return len(self.prompt_token_ids) + self.max_output_tokens
