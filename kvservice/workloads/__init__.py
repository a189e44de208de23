"""Seeded request workloads for the reference scheduler: prefix sharing patterns with
realistic length distributions, each a list of ``RequestSpec``."""

from kvservice.workloads.generators import (
    FewShotConfig,
    LengthDistribution,
    LongDocumentQAConfig,
    MultiTurnChatConfig,
    NoSharingConfig,
    SharedSystemPromptConfig,
    WorkloadConfig,
    generate,
)
from kvservice.workloads.specs import RequestSpec

__all__ = [
    "FewShotConfig",
    "LengthDistribution",
    "LongDocumentQAConfig",
    "MultiTurnChatConfig",
    "NoSharingConfig",
    "RequestSpec",
    "SharedSystemPromptConfig",
    "WorkloadConfig",
    "generate",
]
