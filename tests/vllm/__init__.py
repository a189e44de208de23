"""Tests against the installed vLLM 0.33.0 (requirements/vllm-test.txt).

vLLM is installed without its CUDA dependencies; these variables keep it on the CPU
platform and off the network. Set here, before any test module imports vllm.
"""

import os

for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_key, _value)
