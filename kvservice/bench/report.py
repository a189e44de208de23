"""The benchmark's outputs: the side-by-side table, the JSON document and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvservice.bench.runner import IN_PROCESS, BenchConfig, ModeResult, PoolResult


def percentile(values_ns: list[int], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) in milliseconds; None without values."""
    if not values_ns:
        return None
    ordered = sorted(values_ns)
    rank = min(max(round(q * len(ordered) + 0.5) - 1, 0), len(ordered) - 1)
    return ordered[rank] / 1e6


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def mode_summary(
    result: ModeResult, baseline: ModeResult | None, first: ModeResult | None
) -> dict[str, Any]:
    """One row: throughput, latency, messages per step and the two ratios."""
    steps_per_s = _rate(result.num_steps, result.seconds)
    steps = max(result.num_steps, 1)
    cpu = result.client_cpu_seconds + result.server_cpu_seconds
    summary: dict[str, Any] = {
        "mode": result.mode,
        "num_blocks": result.num_blocks,
        "steps": result.num_steps,
        "seconds": result.seconds,
        "steps_per_s": steps_per_s,
        "ops_per_s": _rate(result.num_ops, result.seconds),
        "p50_ms": percentile(result.latencies_ns, 0.50),
        "p99_ms": percentile(result.latencies_ns, 0.99),
        "p99_full_batch_ms": percentile(result.full_latencies_ns, 0.99),
        # A step split in two: the time inside the KV backend (RPCs included), and the
        # scheduler's own Python around it.
        "backend_p50_ms": percentile(result.backend_latencies_ns, 0.50),
        "backend_p99_ms": percentile(result.backend_latencies_ns, 0.99),
        "scheduler_p50_ms": percentile(result.scheduler_latencies_ns, 0.50),
        "scheduler_p99_ms": percentile(result.scheduler_latencies_ns, 0.99),
        "messages_per_step": (
            None if result.num_sends is None else result.num_sends / max(result.num_steps, 1)
        ),
        "cpu_ms_per_step": 1e3 * cpu / steps,
        "client_cpu_ms_per_step": 1e3 * result.client_cpu_seconds / steps,
        "server_cpu_ms_per_step": 1e3 * result.server_cpu_seconds / steps,
        "decisions_match": result.decisions_match,
        "vs_in_process": None,
        # The same ratio within each round (the modes of a round run back to back, so
        # these see the same machine): their spread is the run's noise.
        "vs_in_process_rounds": None,
        "vs_first_pool": None,
    }
    if baseline is not None and baseline.seconds > 0:
        summary["vs_in_process"] = steps_per_s / _rate(baseline.num_steps, baseline.seconds)
        # Every round runs the same steps, so a round's ratio is one of times.
        summary["vs_in_process_rounds"] = [
            base / seconds
            for base, seconds in zip(baseline.round_seconds, result.round_seconds, strict=True)
            if seconds > 0
        ]
    if first is not None and first is not result and first.seconds > 0:
        summary["vs_first_pool"] = steps_per_s / _rate(first.num_steps, first.seconds)
    return summary


def pool_summary(pool: PoolResult, first_pool: PoolResult) -> dict[str, Any]:
    reference = pool.reference
    return {
        "num_blocks": pool.num_blocks,
        "steps": len(reference.decisions),
        "ops_per_step": reference.total_ops / max(len(reference.decisions), 1),
        "max_scheduled_per_step": max(reference.num_scheduled, default=0),
        "prefix_hit_rate": reference.hit_rate[-1] if reference.hit_rate else 0.0,
        "preemptions": reference.num_preemptions,
        "peak_usage": max(reference.usage, default=0.0),
        "modes": [
            mode_summary(result, pool.modes.get(IN_PROCESS), first_pool.modes.get(mode))
            for mode, result in pool.modes.items()
        ],
    }


def to_json(config: BenchConfig, pools: list[PoolResult]) -> dict[str, Any]:
    """The machine-readable result (``--json``)."""
    return {
        "config": {
            "workload": config.workload,
            "num_requests": config.num_requests,
            "num_blocks": list(config.num_blocks),
            "seed": config.seed,
            "modes": list(config.modes),
            "max_steps": config.max_steps,
            "rounds": config.rounds,
            "max_running": config.max_running,
            "max_batched_tokens": config.max_batched_tokens,
            "arrival_rate": config.arrival_rate,
            "eviction_policy": config.eviction_policy,
            "system_prompt_priority": config.system_prompt_priority,
        },
        "pools": [pool_summary(pool, pools[0]) for pool in pools],
    }


def _fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".", maxsplit=1)[0])
    return "-".rjust(width) if value is None else format(value, spec)


_HEADER = (
    f"{'blocks':>9}  {'mode':<10} {'steps/s':>9} {'ops/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'p99 full':>8} {'msg/step':>8} {'cpu ms':>8} {'vs in-proc':>10} {'per round':>11} "
    f"{'vs pool 1':>9} {'kv p50':>7} {'kv p99':>7} {'sched p50':>9} {'sched p99':>9}"
)


def _spread(ratios: list[float] | None) -> str:
    """The lowest and highest of the per-round ratios, as ``0.45-0.58``."""
    if not ratios:
        return "-".rjust(11)
    return f"{min(ratios):.2f}-{max(ratios):.2f}".rjust(11)


def _retention_words(config: dict[str, Any]) -> str:
    policy, priority = config.get("eviction_policy", "lru"), config.get("system_prompt_priority")
    if policy == "lru" and priority is None:
        return ""
    kept = "" if priority is None else f", system prompts at priority {priority}"
    return f"; eviction policy {policy}{kept}"


def table(document: dict[str, Any]) -> str:
    """The human-readable table of ``to_json``'s document."""
    config = document["config"]
    lines = [
        f"kvservice bench: {config['workload']}, {config['num_requests']} requests "
        f"(seed {config['seed']}), <= {config['max_running']} running, "
        f"{config['max_batched_tokens']} tokens/step, {config['rounds']} rounds "
        f"alternating {', '.join(config['modes'])}" + _retention_words(config),
    ]
    for pool in document["pools"]:
        match = all(m["decisions_match"] for m in pool["modes"])
        lines.append(
            f"pool of {pool['num_blocks']} blocks: {pool['steps']} steps, "
            f"{pool['ops_per_step']:.0f} ops/step, up to {pool['max_scheduled_per_step']} "
            f"requests/step, prefix hit rate {pool['prefix_hit_rate']:.1%}, "
            f"{pool['preemptions']} preemptions, peak usage {pool['peak_usage']:.1%}, "
            f"same decisions in every mode: {'yes' if match else 'NO'}"
        )
    lines.append(_HEADER)
    for pool in document["pools"]:
        for row in pool["modes"]:
            lines.append(
                f"{row['num_blocks']:>9}  {row['mode']:<10} {row['steps_per_s']:>9.1f} "
                f"{row['ops_per_s']:>10.0f} {_fmt(row['p50_ms'], '8.3f')} "
                f"{_fmt(row['p99_ms'], '8.3f')} {_fmt(row['p99_full_batch_ms'], '8.3f')} "
                f"{_fmt(row['messages_per_step'], '8.2f')} {row['cpu_ms_per_step']:8.2f} "
                f"{_fmt(row['vs_in_process'], '10.2f')} {_spread(row['vs_in_process_rounds'])} "
                f"{_fmt(row['vs_first_pool'], '9.2f')} "
                f"{_fmt(row['backend_p50_ms'], '7.3f')} {_fmt(row['backend_p99_ms'], '7.3f')} "
                f"{_fmt(row['scheduler_p50_ms'], '9.3f')} {_fmt(row['scheduler_p99_ms'], '9.3f')}"
            )
    lines.append(
        "p99 full: p99 over the steps that scheduled max_running requests; msg/step: "
        "messages sent per step (one per step, after its decisions: a replica table "
        "answers the scheduler; the stream checks each step while the next is planned); "
        "per round: the lowest and highest ratio to in-process "
        "within one round; cpu ms: "
        "CPU time per step, this process plus a server it started; kv p50/p99: time per "
        "step inside the KV backend (service calls, RPCs included); sched p50/p99: the "
        "rest of the step (the scheduler's own Python)"
    )
    return "\n".join(lines)


def plot(pools: list[PoolResult], path: Path) -> None:
    """Usage, prefix hit rate and step latency (per mode, last round) over the steps of
    the first pool, as a PNG. Needs matplotlib (``pip install 'kvservice[plot]'``)."""
    import matplotlib  # noqa: PLC0415 (optional dependency, loaded only for --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    pool = pools[0]
    steps = list(range(len(pool.reference.usage)))
    figure, (usage_ax, hit_ax, latency_ax) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    usage_ax.plot(steps, [100 * u for u in pool.reference.usage])
    usage_ax.set_ylabel("KV usage %")
    hit_ax.plot(steps, [100 * h for h in pool.reference.hit_rate])
    hit_ax.set_ylabel("prefix hit rate %")
    for mode, result in pool.modes.items():
        latency_ax.plot(steps[: len(result.last_round_ms)], result.last_round_ms, label=mode)
    latency_ax.set_yscale("log")  # unary is orders of magnitude above the rest
    latency_ax.set_ylabel("step latency ms")
    latency_ax.set_xlabel("scheduler step")
    latency_ax.legend()
    figure.suptitle(f"kvservice bench, pool of {pool.num_blocks} blocks")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
