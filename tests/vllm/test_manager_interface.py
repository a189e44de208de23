"""``KVServiceKVCacheManager`` answers everything vLLM's scheduler and engine read of a
``KVCacheManager``, with vLLM's signatures, checked against the installed source: vLLM
0.33.0 in .venv, 0.32.0 in .venv-engine (whose manager takes fewer arguments)."""

from __future__ import annotations

import inspect
import re

import pytest
import vllm
import vllm.v1.core.sched.scheduler as vllm_scheduler
import vllm.v1.engine.core as vllm_engine_core
from vllm.v1.core.kv_cache_manager import KVCacheManager

from kvservice.integrations.vllm import KVServiceKVCacheManager, KVServiceScheduler
from kvservice.integrations.vllm.manager import ManagerArgs
from kvservice.integrations.vllm.testing import SchedulerSetup, build_scheduler
from kvservice.integrations.vllm.versions import release

# What vLLM 0.33 added to the manager's arguments: 0.32's scheduler leaves them out,
# and their defaults mean what 0.32 does.
NEWER_ARGUMENTS = {"0.32": {"num_hash_lookahead_tokens"}, "0.33": set()}[release(vllm.__version__)]

_READ = re.compile(r"kv_cache_manager\.(\w+)")


def _names_read(module: object) -> set[str]:
    return set(_READ.findall(inspect.getsource(module)))  # type: ignore[arg-type]


def test_the_manager_answers_every_name_the_scheduler_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    manager = build_scheduler(SchedulerSetup(), KVServiceScheduler).kv_cache_manager
    read = _names_read(vllm_scheduler) | _names_read(vllm_engine_core)
    assert len(read) > 20  # the pattern still finds the scheduler's reads
    missing = sorted(name for name in read if not hasattr(manager, name))
    assert missing == []


@pytest.mark.parametrize(
    "method", ["allocate_slots", "get_computed_blocks", "free", "get_blocks", "reset_prefix_cache"]
)
def test_signatures_are_vllms(method: str) -> None:
    ours = list(inspect.signature(getattr(KVServiceKVCacheManager, method)).parameters.values())
    theirs = list(inspect.signature(getattr(KVCacheManager, method)).parameters.values())
    # vLLM's parameters, in vLLM's order; after them only optional ones of a newer vLLM
    # (0.33's max_cache_hit_length on 0.32).
    assert [(p.name, p.default) for p in ours[: len(theirs)]] == [
        (p.name, p.default) for p in theirs
    ]
    assert all(p.default is not inspect.Parameter.empty for p in ours[len(theirs) :])


def test_the_constructor_takes_what_the_scheduler_passes() -> None:
    source = inspect.getsource(vllm_scheduler.Scheduler.__init__)
    call = source[source.index("KVCacheManager(") :]
    passed = set(re.findall(r"^\s+(\w+)=", call[: call.index("\n        )")], re.MULTILINE))
    accepted = set(inspect.signature(KVCacheManager.__init__).parameters) - {"self"}
    assert passed and passed <= accepted  # the scheduler passes vLLM's own keywords...
    # ...and we take all of them
    assert set(ManagerArgs.__dataclass_fields__) == accepted | NEWER_ARGUMENTS


def test_connector_reads_match_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reads a KV connector makes mid-run (block ids up to the computed tokens, the
    estimate of cached tokens) equal vLLM's, group by group, on a hybrid pool."""
    from tests.vllm.scheduler_harness import Workload  # noqa: PLC0415

    monkeypatch.delenv("KVSERVICE_TARGET", raising=False)
    setup = SchedulerSetup(
        num_blocks=160, groups=(("full", 16, 0), ("sliding_window", 16, 64)), max_model_len=1024
    )
    schedulers = [build_scheduler(setup), build_scheduler(setup, KVServiceScheduler)]
    reads = []
    for scheduler in schedulers:
        Workload(4, num_requests=30).run(scheduler, max_steps=12, stop_early=True)
        reads.append(
            {
                request_id: (
                    scheduler.kv_cache_manager.get_block_ids_for_computed_tokens(
                        request_id, request.num_computed_tokens
                    ),
                    scheduler.kv_cache_manager.estimate_cached_tokens(request),
                )
                for request_id, request in scheduler.requests.items()
            }
        )
    assert reads[0] and reads[0] == reads[1]
