"""Tiny random decoder models built from configs (no network), and helpers shared by the tests."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvpatch import compat

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)

MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON)),
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 3},
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=64,
        )
    ),
    "gemma2": lambda: Gemma2ForCausalLM(
        Gemma2Config(
            **{**COMMON, "num_hidden_layers": 2},
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=64,
        )
    ),
}


def make_model(name: str = "llama", attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny random fp32 model with GQA (4 query heads, 2 KV heads, head_dim 32)."""
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    compat.set_attention_implementation(model, attn)
    # random weights give flat attention; sharper keys make eviction choices matter
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "k_proj"):
                module.k_proj.weight.mul_(4.0)
    return model


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


def pytest_report_header(config):
    return f"transformers {transformers.__version__}, torch {torch.__version__}"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
