"""Benchmarks: run with `make bench`; they print ratios measured side by side.

Imported before any benchmark module, and so before grpc and vLLM: gRPC without fork
handlers, as ``kvservice serve`` runs it, so ``bench_audit`` may fork its snapshots
(``kvservice.server.forking``); vLLM on the CPU, off the network and quiet
(``VLLM_ENV``, which a caller's own settings override), in this process and in the
workers it starts."""

import os

from kvservice.server.forking import disable_grpc_fork_handlers

VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}

disable_grpc_fork_handlers()
for _key, _value in VLLM_ENV.items():
    os.environ.setdefault(_key, _value)
