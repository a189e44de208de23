"""The CUDA paths (compiled FlexAttention, the plain backend on the GPU); skipped
where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.attention import FlexAttentionBackend, TorchAttentionBackend, select_backend
from tests.gpu_runtime.cases import TOLERANCES, random_case
from tests.gpu_runtime.reference import ref_paged_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("compiled", [True, False], ids=["flex", "torch"])
def test_cuda_backends(seed: int, decode: bool, dtype: torch.dtype, compiled: bool) -> None:
    backend = FlexAttentionBackend(compile=True) if compiled else TorchAttentionBackend()
    case = random_case(seed, dtype, decode=decode, device="cuda", max_seq_len=300)
    out = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    expected = ref_paged_attention(
        case.query.cpu(), case.kv_cache.cpu(), case.metadata, case.tables, case.scale
    )
    torch.testing.assert_close(
        out.cpu().double(), expected, atol=TOLERANCES[dtype][0], rtol=TOLERANCES[dtype][1]
    )


@pytest.mark.parametrize("seed", range(4))
def test_cuda_matmul_decode_fp32(seed: int) -> None:
    # The CPU's fp32 decode path, forced on the GPU: same views, same answers.
    backend = TorchAttentionBackend(matmul_decode=True)
    case = random_case(seed, torch.float32, decode=True, device="cuda", max_seq_len=300)
    out = backend.forward(case.query, case.kv_cache, case.metadata, case.scale)
    expected = ref_paged_attention(
        case.query.cpu(), case.kv_cache.cpu(), case.metadata, case.tables, case.scale
    )
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("compiled", [True, False], ids=["flex", "torch"])
def test_prefix_caching_is_invisible_on_cuda(compiled: bool) -> None:
    # The CPU end-to-end workload (evictions, preemptions, reused blocks), on the GPU.
    pytest.importorskip("cbor2", reason="the core's block hashing needs cbor2")
    from tests.gpu_runtime.test_end_to_end import run_workload  # noqa: PLC0415

    backend = FlexAttentionBackend(compile=True) if compiled else TorchAttentionBackend()
    driver = run_workload(backend, torch.bfloat16, seed=0, device="cuda")
    assert driver.checked > 30 and driver.preemptions > 0


def test_auto_selects_flex_on_cuda() -> None:
    assert isinstance(select_backend("cuda", 8, 2, torch.bfloat16), FlexAttentionBackend)
