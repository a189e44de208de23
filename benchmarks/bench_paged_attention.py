"""Paged decode attention against dense attention on contiguous K/V, side by side.

For each dtype, batch size and context length: one layer's decode step (one query
token per sequence) through the selected backend on a shuffled block table, and
``scaled_dot_product_attention`` on contiguous ``[B, Hkv, ctx, D]`` K/V of the same
shape and dtype (on the CPU for half types also fp32-compute matmuls over the same
K/V; the faster of the two is the baseline, named in the ``dense`` column), timed
alternately in one run (median of ``--iters``). Each call
reads another layer's K/V, cycling through ``--working-set-mib`` of them per side
(twice the CI VM's 32 MiB L3 by default), as a model's decode step reads each layer's
K/V once: with one layer the dense side re-reads cache-hot data. Prints time,
effective bandwidth (KV bytes read / time), the paged/dense ratio (median of the
per-pair ratios) and whether it meets the CPU target (<= 1.5x). On CUDA it also
measures the device's copy bandwidth (``(read + write bytes) / time`` of a large
device-to-device copy) and prints paged bandwidth as a share of it, against the GPU
target (>= 70% at batch >= 32 and context >= 4096). ``--json PATH`` writes every row
and the verdicts.

Run: ``make bench-runtime`` or ``python -m benchmarks.bench_paged_attention
[--batch-sizes 1,8,32] [--context-lens 256,1024,4096] [--dtypes float32,bfloat16]
[--backend auto] [--heads 8,2] [--head-size 64] [--threads 1] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)

from gpu_runtime.attention import BACKEND_NAMES, AttentionMetadata, select_backend
from gpu_runtime.kv_cache import torch_dtype
from kvservice.core.kv_cache_interface import cdiv

MAX_LAYERS = 256
RATIO_TARGET = 1.5  # CPU: paged decode within 1.5x of dense
COPY_FRACTION_TARGET = 0.70  # GPU: paged bandwidth >= 70% of the copy bandwidth ...
GPU_TARGET_MIN_BATCH, GPU_TARGET_MIN_CTX = 32, 4096  # ... at these shapes and above


@dataclass(frozen=True, slots=True)
class Shape:
    """The attention geometry every case shares."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int


@dataclass(frozen=True, slots=True)
class Row:
    """One measured case; times are medians in seconds."""

    dtype: str
    batch: int
    ctx: int
    backend: str
    paged_s: float
    dense_s: float
    ratio: float  # median of paired paged/dense ratios
    kv_bytes: int
    layers: int
    dense_impl: str  # the faster dense implementation, which the ratio is against

    @property
    def paged_gbps(self) -> float:
        return self.kv_bytes / self.paged_s / 1e9

    @property
    def dense_gbps(self) -> float:
        return self.kv_bytes / self.dense_s / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _time_pair(
    a: Callable[[], object],
    b: Callable[[], object],
    iters: int,
    device: torch.device,
    reps: int = 1,
) -> tuple[float, float, float]:
    """Median seconds per call of ``a`` and ``b``, and the median of their per-pair
    ratio. Calls alternate; each sample averages ``reps`` back-to-back calls (GPU:
    amortises the sync). The paired ratio compares samples taken microseconds apart,
    so load from other processes that drifts over the run cancels out of it."""
    for fn in (a, b, a, b):
        fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        times[0].append(_time_once(a, reps, device))
        times[1].append(_time_once(b, reps, device))
    ratios = [x / y for x, y in zip(*times, strict=True)]
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of ``nbytes``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> object:
        return dst.copy_(src)

    seconds, _, _ = _time_pair(copy, copy, iters, device, reps=4 if device.type == "cuda" else 1)
    return 2 * nbytes / seconds


def num_layers_for(kv_bytes: int, working_set_bytes: int) -> int:
    """Layers to cycle through so one side's K/V spans ``working_set_bytes``."""
    return max(1, min(MAX_LAYERS, cdiv(working_set_bytes, kv_bytes)))


def bench_case(
    batch: int,
    ctx: int,
    dtype: torch.dtype,
    shape: Shape,
    device: torch.device,
    backend_name: str,
    iters: int,
    working_set_bytes: int,
) -> Row:
    rng = random.Random(batch * 100_003 + ctx)
    blocks_per_seq = cdiv(ctx, shape.block_size)
    # Twice the blocks in use, shuffled: the table jumps around the pool as in serving.
    num_blocks = 2 * batch * blocks_per_seq + 1
    ids = rng.sample(range(1, num_blocks), batch * blocks_per_seq)
    tables = [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    item = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * ctx * shape.num_kv_heads * shape.head_size * item
    # Each call reads the next layer's K/V, as a model's decode step does, so neither
    # side re-reads data a previous call left in the CPU's caches (or the GPU's L2).
    layers = num_layers_for(kv_bytes, working_set_bytes)
    page = (shape.block_size, shape.num_kv_heads, shape.head_size)
    kv_caches = torch.randn(layers, 2, num_blocks, *page, dtype=dtype, device=device)
    metadata = AttentionMetadata.build(
        [1] * batch, [ctx] * batch, tables, shape.block_size, num_blocks, device
    )
    query = torch.randn(batch, shape.num_q_heads, shape.head_size, dtype=dtype, device=device)
    dense_kv = torch.randn(
        layers, 2, batch, shape.num_kv_heads, ctx, shape.head_size, dtype=dtype, device=device
    )
    dense_q = query[:, :, None]
    backend = select_backend(
        device, shape.num_q_heads, shape.num_kv_heads, dtype, name=backend_name
    )
    turn = {"paged": 0}

    def paged() -> object:
        turn["paged"] = (turn["paged"] + 1) % layers
        return backend.forward(query, kv_caches[turn["paged"]], metadata, validate=False)

    reps = 4 if device.type == "cuda" else 1
    with torch.inference_mode():
        dense_impl, dense = _faster(_dense_variants(dense_q, dense_kv, device), device, reps)
        t_paged, t_dense, ratio = _time_pair(paged, dense, iters, device, reps)
    return Row(
        str(dtype).removeprefix("torch."),
        batch,
        ctx,
        backend.name,
        t_paged,
        t_dense,
        ratio,
        kv_bytes,
        layers,
        dense_impl,
    )


def _dense_variants(
    query: torch.Tensor, dense_kv: torch.Tensor, device: torch.device
) -> dict[str, Callable[[], object]]:
    """Dense decode over contiguous ``[layers, 2, B, Hkv, ctx, D]`` K/V, each call on
    the next layer: SDPA in the cache's dtype, and on the CPU for half types also
    matmuls computed in fp32 (what the paged CPU path does; bf16 SDPA is slow on CPUs,
    so a baseline of it alone would flatter the paged side)."""
    layers = dense_kv.shape[0]
    turn = {"sdpa": 0, "f32-matmul": 0}

    def sdpa() -> object:
        turn["sdpa"] = (turn["sdpa"] + 1) % layers
        kv = dense_kv[turn["sdpa"]]
        return F.scaled_dot_product_attention(query, kv[0], kv[1], enable_gqa=True)

    variants: dict[str, Callable[[], object]] = {"sdpa": sdpa}
    if device.type == "cpu" and dense_kv.dtype in (torch.bfloat16, torch.float16):
        batch, num_q_heads, _, head_size = query.shape
        num_kv_heads = dense_kv.shape[3]
        # [B, Hq, 1, D] -> [B, Hkv, group, D]: a KV head's query heads are the rows.
        grouped = query.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_size)
        scale = head_size**-0.5
        # Converted into buffers allocated once, as the paged path does: a fresh fp32
        # copy of the whole K/V per call costs page faults, not attention.
        keys = torch.empty(dense_kv.shape[2:], dtype=torch.float32, device=device)
        values = torch.empty_like(keys)

        def f32_matmul() -> object:
            turn["f32-matmul"] = (turn["f32-matmul"] + 1) % layers
            kv = dense_kv[turn["f32-matmul"]]
            keys.copy_(kv[0])
            values.copy_(kv[1])
            scores = (grouped.float() * scale) @ keys.transpose(-1, -2)
            out = torch.softmax(scores, dim=-1) @ values
            return out.reshape(batch, num_q_heads, 1, head_size).to(query.dtype)

        variants["f32-matmul"] = f32_matmul
    return variants


def _faster(
    variants: dict[str, Callable[[], object]], device: torch.device, reps: int
) -> tuple[str, Callable[[], object]]:
    """The variant with the lowest median over a few alternating calls."""
    if len(variants) == 1:
        return next(iter(variants.items()))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):
        for name, fn in variants.items():
            samples[name].append(_time_once(fn, reps, device))
    best = min(samples, key=lambda name: statistics.median(samples[name]))
    return best, variants[best]


def _in_gpu_target(row: Row) -> bool:
    return row.batch >= GPU_TARGET_MIN_BATCH and row.ctx >= GPU_TARGET_MIN_CTX


def _print_row(row: Row, copy_gbps: float | None) -> None:
    line = (
        f"{row.dtype:>9} {row.batch:>5} {row.ctx:>6} {row.layers:>6} {row.backend:>8} "
        f"{row.paged_s * 1e3:>9.3f} {row.paged_gbps:>10.2f} {row.dense_s * 1e3:>9.3f} "
        f"{row.dense_gbps:>10.2f} {row.dense_impl:>10} {row.ratio:>6.2f} "
        f"{'yes' if row.ratio <= RATIO_TARGET else 'NO':>6}"
    )
    if copy_gbps is not None:
        share = row.paged_gbps / copy_gbps
        verdict = ("yes" if share >= COPY_FRACTION_TARGET else "NO") if _in_gpu_target(row) else "-"
        line += f" {share:>7.1%} {verdict:>6}"
    print(line, flush=True)


def _summarise(rows: list[Row], copy_gbps: float | None) -> dict[str, object]:
    met = [r for r in rows if r.ratio <= RATIO_TARGET]
    missed = [f"{r.dtype} b{r.batch} ctx{r.ctx} ({r.ratio:.2f}x)" for r in rows if r not in met]
    print(
        f"ratio target paged/dense <= {RATIO_TARGET}x: met at {len(met)} of {len(rows)} "
        f"shapes; missed at: {', '.join(missed) or 'none'}"
    )
    summary: dict[str, object] = {"ratio_met": len(met), "ratio_missed": missed}
    if copy_gbps is not None:
        targeted = [r for r in rows if _in_gpu_target(r)]
        short = [
            f"{r.dtype} b{r.batch} ctx{r.ctx} ({r.paged_gbps / copy_gbps:.1%})"
            for r in targeted
            if r.paged_gbps / copy_gbps < COPY_FRACTION_TARGET
        ]
        print(
            f"bandwidth target >= {COPY_FRACTION_TARGET:.0%} of copy ({copy_gbps:.1f} GB/s) at "
            f"batch >= {GPU_TARGET_MIN_BATCH}, ctx >= {GPU_TARGET_MIN_CTX}: "
            f"{len(targeted) - len(short)} of {len(targeted)} shapes; "
            f"missed at: {', '.join(short) or 'none'}"
        )
        summary.update(copy_gbps=copy_gbps, bandwidth_checked=len(targeted), bandwidth_missed=short)
    return summary


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context-lens", default="256,1024,4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backend", default="auto", choices=BACKEND_NAMES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--heads", default="8,2", help="query heads,KV heads")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument(
        "--working-set-mib",
        type=int,
        default=64,
        help="K/V each side cycles through, in layers of the case's size; 1 layer when "
        "0 (the same K/V every call, cache-hot)",
    )
    # One thread by default on CPU: on a shared 2-core VM OpenMP spin-waits make
    # two-thread timings swing by 10x; both sides run under the same setting.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the copy (CUDA)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    num_q_heads, num_kv_heads = (int(h) for h in args.heads.split(","))
    shape = Shape(num_q_heads, num_kv_heads, args.head_size, args.block_size)
    print(
        f"paged decode vs dense attention, one layer per call: Hq={num_q_heads} "
        f"Hkv={num_kv_heads} D={shape.head_size} block_size={shape.block_size}, "
        f"device={device}, threads={args.threads}, torch {torch.__version__}"
    )
    if args.working_set_mib > 0:
        print(
            f"each side cycles through 'layers' copies of its K/V (>= {args.working_set_mib} "
            f"MiB in all, at most {MAX_LAYERS}), so no call finds the previous one's data in "
            f"cache"
        )
    else:
        print("each side reads the same K/V on every call (cache-hot where it fits)")
    copy_gbps = None
    if device.type == "cuda":
        copy_gbps = copy_bandwidth(device, args.copy_mib << 20, args.iters) / 1e9
        print(f"device-to-device copy bandwidth (read + write): {copy_gbps:.1f} GB/s")
    header = (
        f"{'dtype':>9} {'batch':>5} {'ctx':>6} {'layers':>6} {'backend':>8} {'paged ms':>9} "
        f"{'paged GB/s':>10} {'dense ms':>9} {'dense GB/s':>10} {'dense':>10} {'ratio':>6} "
        f"{'<=1.5x':>6}" + (f" {'of copy':>7} {'>=70%':>6}" if copy_gbps else "")
    )
    print(header)
    print("-" * len(header))
    rows = []
    for dtype_name in args.dtypes.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for ctx in (int(c) for c in args.context_lens.split(",")):
                row = bench_case(
                    batch,
                    ctx,
                    torch_dtype(dtype_name),
                    shape,
                    device,
                    args.backend,
                    args.iters,
                    args.working_set_mib << 20,
                )
                _print_row(row, copy_gbps)
                rows.append(row)
    summary = _summarise(rows, copy_gbps)
    if args.json:
        report = {
            "device": str(device),
            "torch": torch.__version__,
            "shape": asdict(shape),
            "rows": [asdict(r) | {"paged_gbps": r.paged_gbps} for r in rows],
            **summary,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
