"""kvservice: vLLM v1's KV-cache block manager, run as a network service."""

__version__ = "0.1.0"
