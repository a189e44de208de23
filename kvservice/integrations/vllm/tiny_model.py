"""A tiny Llama built on the spot, for a real vLLM engine with nothing downloaded.

Seeded random weights (``transformers``' ``LlamaForCausalLM``) and a word-level
tokenizer (``w0`` ... ``w507``, split on whitespace), saved as a Hugging Face model
directory that vLLM's ``LLM``, ``LLMEngine`` and OpenAI server load like any other.
Its shape suits vLLM's CPU attention (head size 32); greedy float32 decoding on it is
deterministic, so two engines given the same prompts must produce the same tokens.
Used by the end-to-end tests and ``benchmarks/bench_vllm_engine.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
EOS_TOKEN_ID = 2
MAX_POSITIONS = 2048


def word(token_id: int) -> str:
    """The text of a non-special token id."""
    return f"w{token_id - len(SPECIAL_TOKENS)}"


def text(token_ids: list[int]) -> str:
    """A prompt whose tokenization is exactly ``token_ids`` (no special tokens)."""
    return " ".join(word(token_id) for token_id in token_ids)


def build_tiny_llama(path: Path, seed: int = 0, sliding_window: int | None = None) -> Path:
    """Write the model and its tokenizer into ``path`` (created); ``path``. With
    ``sliding_window``, a Mistral of the same shape whose every layer attends to that
    many tokens (vLLM then lays out one sliding-window KV cache group)."""
    # The heavy imports only where a model is built.
    import torch  # noqa: PLC0415
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
    )

    path.mkdir(parents=True, exist_ok=True)
    shape: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    model: Any
    if sliding_window is None:
        model = LlamaForCausalLM(LlamaConfig(**shape))  # type: ignore[no-untyped-call]
    else:
        config = MistralConfig(**shape, sliding_window=sliding_window)
        model = MistralForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(path)

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
    ).save_pretrained(path)
    # A completion prompt is the words as written: no BOS added in front.
    tokenizer_config = path / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["add_bos_token"] = False
    tokenizer_config.write_text(json.dumps(settings, indent=2))
    return path
