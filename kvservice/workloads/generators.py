"""Seeded workload generators: the prefix sharing patterns a serving engine sees.

Every generator draws from one ``random.Random(seed)``, so a config and a seed name a
workload exactly. Token ids are random draws from the vocabulary: two independent
16-token blocks practically never collide, so sharing happens only where a workload
repeats tokens on purpose (a system prompt, a conversation, a document).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvservice.workloads.specs import RequestSpec


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A lognormal length around ``median`` (spread ``sigma``), clipped to
    ``[low, high]``: long-tailed like real prompt and output lengths."""

    median: float
    sigma: float = 0.5
    low: int = 1
    high: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(value, self.low), self.high)


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """What every workload shares: vocabulary, output lengths, arrivals, priorities.

    Arrivals are a Poisson process of ``requests_per_step`` (per group of related
    requests, for the grouped kinds); ``num_priorities`` > 1 draws each request's
    priority uniformly from ``range(num_priorities)``. ``max_model_len`` bounds
    prompt plus output of every request.
    """

    vocab_size: int = 32_000
    output_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=32, sigma=0.6, low=1, high=256)
    )
    requests_per_step: float = 1.0
    num_priorities: int = 1
    max_model_len: int = 8192


@dataclass(frozen=True, kw_only=True)
class SharedSystemPromptConfig(WorkloadConfig):
    """Many users behind a few long system prompts, each with a short message."""

    num_requests: int = 32
    num_system_prompts: int = 1
    system_prompt_len: int = 512
    # Keep the system prompts at this eviction priority (None: none).
    system_prompt_priority: int | None = None
    user_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=64, sigma=0.7, low=1, high=1024)
    )


@dataclass(frozen=True, kw_only=True)
class MultiTurnChatConfig(WorkloadConfig):
    """Conversations whose every turn resends the whole previous conversation (prompt
    and reply) plus a new user message; turns of one conversation are
    ``turn_gap_steps`` apart."""

    num_conversations: int = 8
    turns_per_conversation: int = 4
    user_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=48, sigma=0.7, low=1, high=512)
    )
    turn_gap_steps: int = 8


@dataclass(frozen=True, kw_only=True)
class FewShotConfig(WorkloadConfig):
    """Few-shot prompts: each task is an instruction and an ordered list of examples;
    a request takes the first k of them (k drawn per request) and a question, so
    requests of one task share prefixes of varying depth."""

    num_requests: int = 32
    num_tasks: int = 2
    instruction_len: int = 64
    examples_per_task: int = 8
    min_examples: int = 2
    example_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=96, sigma=0.4, low=8, high=512)
    )
    question_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=32, sigma=0.5, low=1, high=256)
    )


@dataclass(frozen=True, kw_only=True)
class LongDocumentQAConfig(WorkloadConfig):
    """Several questions about each long document, each prompt the whole document and
    one question; a document's questions arrive together."""

    num_documents: int = 4
    questions_per_document: int = 4
    document_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=2048, sigma=0.3, low=256, high=6144)
    )
    question_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=24, sigma=0.5, low=1, high=128)
    )


@dataclass(frozen=True, kw_only=True)
class NoSharingConfig(WorkloadConfig):
    """Independent prompts: the prefix cache never hits (the baseline)."""

    num_requests: int = 32
    prompt_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution(median=256, sigma=0.8, low=1, high=4096)
    )


class _Draw:
    """The generator state one workload shares: the RNG, the clock and the ids."""

    def __init__(self, config: WorkloadConfig, seed: int, prefix: str) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.prefix = prefix
        self.clock = 0.0
        self.specs: list[RequestSpec] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.config.vocab_size) for _ in range(n)]

    def next_arrival(self) -> int:
        # Exponential gaps: a Poisson process in (fractional) steps.
        self.clock += self.rng.expovariate(self.config.requests_per_step)
        return int(self.clock)

    def add(
        self,
        prompt: list[int],
        arrival_step: int,
        prefix_priority: int | None = None,
        prefix_len: int = 0,
    ) -> RequestSpec | None:
        """Append a spec with a drawn output length fitted under ``max_model_len``;
        None (nothing added) when the prompt leaves no room for one output token."""
        room = self.config.max_model_len - len(prompt)
        if room < 1:
            return None
        priority = self.rng.randrange(self.config.num_priorities)
        spec = RequestSpec(
            request_id=f"{self.prefix}-{len(self.specs)}",
            prompt_token_ids=tuple(prompt),
            max_output_tokens=min(self.config.output_len.sample(self.rng), room),
            arrival_step=arrival_step,
            priority=priority,
            prefix_priority=prefix_priority,
            prefix_len=prefix_len,
        )
        self.specs.append(spec)
        return spec


def _shared_system_prompt(config: SharedSystemPromptConfig, draw: _Draw) -> None:
    system_prompts = [
        draw.tokens(config.system_prompt_len) for _ in range(config.num_system_prompts)
    ]
    for _ in range(config.num_requests):
        system = draw.rng.choice(system_prompts)
        draw.add(
            system + draw.tokens(config.user_len.sample(draw.rng)),
            draw.next_arrival(),
            config.system_prompt_priority,
            len(system),
        )


def _multi_turn_chat(config: MultiTurnChatConfig, draw: _Draw) -> None:
    for _ in range(config.num_conversations):
        arrival = draw.next_arrival()
        history: list[int] = []
        for _ in range(config.turns_per_conversation):
            prompt = history + draw.tokens(config.user_len.sample(draw.rng))
            spec = draw.add(prompt, arrival)
            if spec is None:
                break  # the conversation outgrew the context window
            # The reply the next turn resends: its length is the turn's output budget.
            # Its tokens are drawn here, not taken from the run, so the workload stays
            # independent of the scheduler (only the prompt part is a guaranteed hit).
            history = prompt + draw.tokens(spec.max_output_tokens)
            arrival += config.turn_gap_steps


def _few_shot(config: FewShotConfig, draw: _Draw) -> None:
    tasks: list[tuple[list[int], list[list[int]]]] = []
    for _ in range(config.num_tasks):
        examples = [
            draw.tokens(config.example_len.sample(draw.rng))
            for _ in range(config.examples_per_task)
        ]
        tasks.append((draw.tokens(config.instruction_len), examples))
    for _ in range(config.num_requests):
        instruction, examples = draw.rng.choice(tasks)
        k = draw.rng.randint(min(config.min_examples, len(examples)), len(examples))
        prompt = list(instruction)
        for example in examples[:k]:
            prompt += example
        draw.add(prompt + draw.tokens(config.question_len.sample(draw.rng)), draw.next_arrival())


def _long_document_qa(config: LongDocumentQAConfig, draw: _Draw) -> None:
    for _ in range(config.num_documents):
        document = draw.tokens(config.document_len.sample(draw.rng))
        arrival = draw.next_arrival()
        for _ in range(config.questions_per_document):
            draw.add(document + draw.tokens(config.question_len.sample(draw.rng)), arrival)


def _no_sharing(config: NoSharingConfig, draw: _Draw) -> None:
    for _ in range(config.num_requests):
        draw.add(draw.tokens(config.prompt_len.sample(draw.rng)), draw.next_arrival())


def generate(config: WorkloadConfig, seed: int) -> list[RequestSpec]:
    """The workload ``config`` describes, drawn with ``seed``, in arrival order (ties
    keep generation order, so a conversation's turns stay in sequence)."""
    match config:
        case SharedSystemPromptConfig():
            draw = _Draw(config, seed, "sys")
            _shared_system_prompt(config, draw)
        case MultiTurnChatConfig():
            draw = _Draw(config, seed, "chat")
            _multi_turn_chat(config, draw)
        case FewShotConfig():
            draw = _Draw(config, seed, "fewshot")
            _few_shot(config, draw)
        case LongDocumentQAConfig():
            draw = _Draw(config, seed, "docqa")
            _long_document_qa(config, draw)
        case NoSharingConfig():
            draw = _Draw(config, seed, "plain")
            _no_sharing(config, draw)
        case _:
            raise TypeError(f"no generator for {type(config).__name__}")
    return sorted(draw.specs, key=lambda spec: spec.arrival_step)
