"""Shared settings of the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # torch warns once at import when numpy is absent; the runtime never uses numpy.
    config.addinivalue_line("filterwarnings", "ignore:Failed to initialize NumPy")
    # Eager FlexAttention (the CPU test path) warns that it is unfused; that is intended.
    config.addinivalue_line(
        "filterwarnings", "ignore:.*flex_attention called without torch.compile"
    )


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> Iterator[None]:
    # The tensors here are tiny: OpenMP fork/join on 2 shared cores costs far more than
    # the math (a run of the end-to-end test takes ~15x longer with 2 threads).
    # Imported here, not at the top: pytest_configure must install the numpy filter
    # before torch is first imported.
    import torch  # noqa: PLC0415

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
