"""Paged decode attention against dense attention on contiguous K/V, side by side.

For each batch size and context length: one layer's decode step (one query token per
sequence) through the selected backend on a shuffled block table, and
``scaled_dot_product_attention`` on contiguous ``[B, Hkv, ctx, D]`` K/V of the same
shape, timed alternately in one run (median of ``--iters``). Prints time, effective
bandwidth (KV bytes read / time) and the paged/dense ratio. Run: ``make bench-runtime``
or ``python -m benchmarks.bench_paged_attention [--batch-sizes 1,8,32]
[--context-lens 256,1024,4096] [--dtypes float32,bfloat16] [--backend auto]
[--threads 1]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional alias)

from gpu_runtime.attention import BACKEND_NAMES, AttentionMetadata, select_backend
from gpu_runtime.kv_cache import torch_dtype
from kvservice.core.kv_cache_interface import cdiv

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_pair(
    a: Callable[[], object], b: Callable[[], object], iters: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``, alternated so noise hits both alike."""
    for fn in (a, b, a, b):
        fn()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for fn, out in ((a, times[0]), (b, times[1])):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def bench_case(
    batch: int,
    ctx: int,
    dtype: torch.dtype,
    device: torch.device,
    backend_name: str,
    iters: int,
) -> tuple[str, float, float, int]:
    rng = random.Random(batch * 100_003 + ctx)
    blocks_per_seq = cdiv(ctx, BLOCK_SIZE)
    # Twice the blocks in use, shuffled: the table jumps around the pool as in serving.
    num_blocks = 2 * batch * blocks_per_seq + 1
    ids = rng.sample(range(1, num_blocks), batch * blocks_per_seq)
    tables = [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    kv_cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype, device=device
    )
    metadata = AttentionMetadata.build(
        [1] * batch, [ctx] * batch, tables, BLOCK_SIZE, num_blocks, device
    )
    query = torch.randn(batch, NUM_Q_HEADS, HEAD_SIZE, dtype=dtype, device=device)
    dense_k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_SIZE, dtype=dtype, device=device)
    dense_v = torch.randn_like(dense_k)
    dense_q = query[:, :, None]
    backend = select_backend(device, NUM_Q_HEADS, NUM_KV_HEADS, dtype, name=backend_name)

    def paged() -> object:
        return backend.forward(query, kv_cache, metadata, validate=False)

    def dense() -> object:
        return F.scaled_dot_product_attention(dense_q, dense_k, dense_v, enable_gqa=True)

    with torch.inference_mode():
        t_paged, t_dense = _time_pair(paged, dense, iters, device)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_SIZE * kv_cache.element_size()
    return backend.name, t_paged, t_dense, kv_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context-lens", default="256,1024,4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backend", default="auto", choices=BACKEND_NAMES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=15)
    # One thread by default on CPU: on a shared 2-core VM OpenMP spin-waits make
    # two-thread timings swing by 10x; both sides run under the same setting.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"paged decode vs dense SDPA, one layer: Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} "
        f"D={HEAD_SIZE} block_size={BLOCK_SIZE}, device={device}, threads={args.threads}, "
        f"torch {torch.__version__}"
    )
    header = (
        f"{'dtype':>9} {'batch':>5} {'ctx':>6} {'backend':>8} {'paged ms':>9} "
        f"{'paged GB/s':>10} {'dense ms':>9} {'dense GB/s':>10} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtypes.split(","):
        dtype = torch_dtype(dtype_name)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for ctx in (int(c) for c in args.context_lens.split(",")):
                name, t_paged, t_dense, kv_bytes = bench_case(
                    batch, ctx, dtype, device, args.backend, args.iters
                )
                print(
                    f"{dtype_name:>9} {batch:>5} {ctx:>6} {name:>8} {t_paged * 1e3:>9.3f} "
                    f"{kv_bytes / t_paged / 1e9:>10.2f} {t_dense * 1e3:>9.3f} "
                    f"{kv_bytes / t_dense / 1e9:>10.2f} {t_paged / t_dense:>6.2f}"
                )


if __name__ == "__main__":
    main()
