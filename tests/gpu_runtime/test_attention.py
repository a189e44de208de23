"""Paged attention against dense attention on the gathered keys and values."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.attention import (
    BACKEND_ENV,
    AttentionBackend,
    AttentionMetadata,
    FlexAttentionBackend,
    TorchAttentionBackend,
    select_backend,
)
from gpu_runtime.attention.torch_backend import _MatmulDecode
from kvservice.core.errors import InvalidArgumentError
from tests.gpu_runtime.cases import TOLERANCES, Case, random_case
from tests.gpu_runtime.reference import ref_paged_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_against_reference(
    backend: AttentionBackend,
    seed: int,
    dtype: torch.dtype,
    *,
    decode: bool,
    gqa_ratios: tuple[int, ...] = (1, 2, 4),
) -> None:
    case = random_case(seed, dtype, decode=decode, gqa_ratios=gqa_ratios)
    out = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    expected = ref_paged_attention(
        case.query, case.kv_cache, case.metadata, case.tables, case.scale
    )
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(
        out.double(), expected, atol=TOLERANCES[dtype][0], rtol=TOLERANCES[dtype][1]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("seed", range(8))
def test_torch_backend(seed: int, decode: bool, dtype: torch.dtype) -> None:
    # GQA 3 is legal for the plain backend (only compiled flex needs a power of two).
    check_against_reference(
        TorchAttentionBackend(), seed, dtype, decode=decode, gqa_ratios=(1, 2, 3, 4)
    )


@pytest.mark.parametrize("seed", range(6))
def test_torch_backend_decode_in_chunks(seed: int) -> None:
    # A one-byte budget forces one sequence per chunk; 4 KiB mixes chunk widths.
    for budget in (1, 4096):
        check_against_reference(TorchAttentionBackend(budget), seed, torch.float32, decode=True)


@pytest.mark.parametrize("matmul", [True, False], ids=["matmul", "sdpa"])
@pytest.mark.parametrize("budget", [None, 1, 4096])
@pytest.mark.parametrize("seed", range(6))
def test_fp32_decode_paths_match_the_reference(seed: int, budget: int | None, matmul: bool) -> None:
    # fp32 on the CPU decodes with matmuls by default; SDPA stays reachable (CUDA's
    # path). Longer sequences than the other tests: chunks then hold
    # from one sequence (budget 1) to all of them.
    case = random_case(seed, torch.float32, decode=True, gqa_ratios=(1, 2, 3, 4), max_seq_len=300)
    backend = TorchAttentionBackend(budget, matmul_decode=matmul)
    out = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    expected = ref_paged_attention(
        case.query, case.kv_cache, case.metadata, case.tables, case.scale
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("budget", [None, 1, 4096])
@pytest.mark.parametrize("seed", range(8))
def test_half_decode_computes_in_fp32_matmuls(
    seed: int, budget: int | None, dtype: torch.dtype
) -> None:
    # Half types on the CPU gather in their own dtype, convert each chunk to fp32 and
    # run the fp32 matmuls; the answer comes back in the query's dtype.
    case = random_case(seed, dtype, decode=True, gqa_ratios=(1, 2, 3, 4), max_seq_len=300)
    backend = TorchAttentionBackend(budget)
    out = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    setup = case.metadata.plans[backend]
    assert isinstance(setup, _MatmulDecode)
    assert all(step.converted is not None for step in setup.steps)
    expected = ref_paged_attention(
        case.query, case.kv_cache, case.metadata, case.tables, case.scale
    )
    assert out.dtype == dtype and out.shape == case.query.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def _ragged_decode_case(
    num_kv_heads: int, dtype: torch.dtype = torch.float32
) -> tuple[Case, list[list[int]]]:
    """Five sequences of different lengths (one a block plus one token): more sequences
    than KV heads, so one chunk batches the matmuls per KV head with a length mask."""
    block_size, head_size, seq_lens = 4, 16, [9, 1, 30, 17, 5]
    ids = iter(range(1, 100))
    tables = [[next(ids) for _ in range(-(-n // block_size))] for n in seq_lens]
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(2, 100, block_size, num_kv_heads, head_size, generator=gen) * 3
    metadata = AttentionMetadata.build([1] * 5, seq_lens, tables, block_size, 100)
    query = torch.randn(5, 2 * num_kv_heads, head_size, generator=gen)
    case = Case(query.to(dtype), kv_cache.to(dtype), metadata, tables, head_size**-0.5)
    return case, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [None, 1], ids=["per-head", "per-sequence"])
def test_matmul_decode_groupings(budget: int | None, dtype: torch.dtype) -> None:
    case, tables = _ragged_decode_case(num_kv_heads=2, dtype=dtype)
    backend = TorchAttentionBackend(budget, matmul_decode=True)
    out = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    expected = ref_paged_attention(case.query, case.kv_cache, case.metadata, tables, case.scale)
    assert out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
    setup = case.metadata.plans[backend]
    assert isinstance(setup, _MatmulDecode)
    # fp32 reads the gather workspace itself; half types a converted fp32 copy of it.
    half = dtype != torch.float32
    assert all((step.converted is not None) == half for step in setup.steps)
    # The grouping the budget implies, masked only where lengths differ in a batch.
    groups = [g for step in setup.steps for g in step.groups]
    assert all(g.key.dtype == torch.float32 for g in groups)
    if budget is None:
        assert len(groups) == 2 and all(g.bias is not None for g in groups)
    else:
        assert len(groups) == 5 and all(g.bias is None for g in groups)


def test_matmul_decode_outputs_are_not_aliased() -> None:
    # The step's output buffer is reused by every layer: each call must return its
    # own tensor, untouched by the next layer's call.
    case, tables = _ragged_decode_case(num_kv_heads=1)
    backend = TorchAttentionBackend(matmul_decode=True)
    first = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    kept = first.clone()
    other = torch.randn_like(case.kv_cache)
    second = backend.forward(-case.query, other, case.metadata, case.scale)
    assert torch.equal(first, kept)
    expected = ref_paged_attention(-case.query, other, case.metadata, tables, case.scale)
    torch.testing.assert_close(second.double(), expected, atol=1e-3, rtol=1e-3)
    # Another query head count on the same step rebuilds the setup rather than reuse it.
    wider = case.query.repeat_interleave(2, dim=1)
    out = backend.forward(wider, case.kv_cache, case.metadata, case.scale)
    expected = ref_paged_attention(wider, case.kv_cache, case.metadata, tables, case.scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("seed", range(4))
def test_flex_backend_eager(seed: int, decode: bool, dtype: torch.dtype) -> None:
    # Eager flex evaluates mask_mod at every pool position, which proves the mask exact;
    # the compiled kernel then only skips blocks the BlockMask leaves out.
    check_against_reference(FlexAttentionBackend(compile=False), seed, dtype, decode=decode)


@pytest.mark.parametrize("budget", [None, 1])
def test_torch_backend_decode_reuses_the_step_plan(budget: int | None) -> None:
    # The decode plan and workspace views are cached on the metadata and shared by the
    # step's layers: each layer's cache (other values, another dtype, after a bigger
    # batch regrew the workspace) must still get its own exact answer.
    backend = TorchAttentionBackend(budget)
    case = random_case(3, torch.float32, decode=True)
    bigger = random_case(4, torch.float32, decode=True, max_seq_len=140)

    def check(query: torch.Tensor, kv_cache: torch.Tensor, *, validate: bool = True) -> None:
        out = backend.forward(query, kv_cache, case.metadata, case.scale, validate=validate)
        expected = ref_paged_attention(query, kv_cache, case.metadata, case.tables, case.scale)
        tol = TOLERANCES[kv_cache.dtype]
        torch.testing.assert_close(out.double(), expected, atol=tol[0], rtol=tol[1])

    check(case.query, case.kv_cache)
    check(case.query, case.kv_cache, validate=False)
    check(-case.query, torch.randn_like(case.kv_cache), validate=False)  # another layer
    backend.forward(bigger.query, bigger.kv_cache, bigger.metadata, bigger.scale)
    check(case.query, case.kv_cache, validate=False)
    check(case.query.bfloat16(), case.kv_cache.bfloat16(), validate=False)
    check(case.query, case.kv_cache)


def test_bad_attention_input_is_refused() -> None:
    case = random_case(0, torch.float32, decode=True)
    backend = TorchAttentionBackend()
    q, kv, meta = case.query, case.kv_cache, case.metadata
    with pytest.raises(InvalidArgumentError, match=r"query has dtype torch.float16 but kv_cache"):
        backend.forward(q.half(), kv, meta)
    with pytest.raises(InvalidArgumentError, match=r"query has shape .* head_size"):
        backend.forward(q[..., :-1], kv, meta)
    with pytest.raises(InvalidArgumentError, match=r"query has .* tokens .* sum to"):
        backend.forward(torch.cat([q, q]), kv, meta)
    with pytest.raises(InvalidArgumentError, match=r"query must be 3-D"):
        backend.forward(q[0], kv, meta)


def test_bad_metadata_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"sequence 1: block table has 1 blocks"):
        AttentionMetadata.build([1, 1], [3, 5], [[1], [2]], 4, 8)
    with pytest.raises(InvalidArgumentError, match=r"sequence 0: block table holds block 9"):
        AttentionMetadata.build([1], [3], [[9]], 4, 8)
    with pytest.raises(InvalidArgumentError, match=r"query_len 4 must be in \[1, seq_len=3\]"):
        AttentionMetadata.build([4], [3], [[1]], 4, 8)
    with pytest.raises(InvalidArgumentError, match=r"written into the null block"):
        AttentionMetadata.build([1], [5], [[1, 0]], 4, 8)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(select_backend("cpu", 4, 2, torch.float32), TorchAttentionBackend)
    flex = select_backend("cpu", 4, 2, torch.float32, name="flex-eager")
    assert isinstance(flex, FlexAttentionBackend) and not flex.compile
    monkeypatch.setenv(BACKEND_ENV, "flex")
    assert isinstance(select_backend("cpu", 4, 2, torch.float32), FlexAttentionBackend)
    with pytest.raises(InvalidArgumentError, match="unknown attention backend 'nope'"):
        select_backend("cpu", 4, 2, torch.float32, name="nope")
    assert not FlexAttentionBackend.supports(6, 2, torch.float32)
