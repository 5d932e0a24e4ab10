"""Tiny random decoder models built from configs, for tests, benchmarks and the eval harness.

Nothing is downloaded: every model here is a transformers class with random weights. The default
is small enough for a unit test (2 layers, 4 query heads sharing 2 KV heads, head_dim 32); pass
config fields to make it larger, e.g. ``tiny_model(num_hidden_layers=8, hidden_size=512)``.
"""

from __future__ import annotations

import torch

from kvpatch import compat

VOCAB = 256

#: config fields shared by every family (a byte-sized vocabulary, GQA with groups of 2)
DEFAULTS = dict(
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

#: what each family adds to the defaults: Gemma's sliding layers, Mistral without a window
FAMILY_FIELDS = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"pad_token_id": None},  # fused q/k/v projection
    "olmo2": {},  # q/k norms over every head together
    "mistral-sliding": {"sliding_window": 64},  # every layer a sliding window
    "gemma2": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 64,
    },
    "gemma3": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 64,
    },
}

FAMILIES = tuple(FAMILY_FIELDS)


def _classes(family: str):
    import transformers

    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
        "mistral-sliding": ("MistralConfig", "MistralForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    }
    config, model = names[family]
    return getattr(transformers, config), getattr(transformers, model)


def tiny_config(family: str = "llama", **fields):
    """The config of a tiny ``family`` model; ``fields`` override the defaults."""
    if family not in FAMILY_FIELDS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    config_class, _ = _classes(family)
    return config_class(**{**DEFAULTS, **FAMILY_FIELDS[family], **fields})


def tiny_model(
    family: str = "llama",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    key_scale: float = 1.0,
    device: str | torch.device | None = None,
    **fields,
) -> torch.nn.Module:
    """A tiny random model in eval mode.

    Parameters
    ----------
    family : one of :data:`FAMILIES`.
    attn_implementation : the stock attention backend.
    seed : seeds the random weights.
    key_scale : multiplies every key projection. Random weights give nearly flat attention;
        sharper keys (e.g. 4) make the choice of what to evict matter, as in a trained model.
    device : where the weights live (default: torch's default device).
    fields : config fields overriding :data:`DEFAULTS`.
    """
    config = tiny_config(family, **fields)
    _, model_class = _classes(family)
    torch.manual_seed(seed)
    with torch.device(device or torch.get_default_device()):
        model = model_class(config).to(dtype).eval()
    compat.set_attention_implementation(model, attn_implementation)
    if key_scale != 1.0:
        with torch.no_grad():
            for module in model.modules():
                if _has_keys(module):
                    _key_weight(module, config).mul_(key_scale)
    return model


def _has_keys(module: torch.nn.Module) -> bool:
    return hasattr(module, "k_proj") or hasattr(module, "qkv_proj")


def _key_weight(module: torch.nn.Module, config) -> torch.Tensor:
    """The rows of the key projection (a slice of a fused q/k/v projection)."""
    if hasattr(module, "k_proj"):
        return module.k_proj.weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    queries = config.num_attention_heads * head_dim
    return module.qkv_proj.weight[queries : queries + config.num_key_value_heads * head_dim]


def random_prompt(length: int, batch: int = 1, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    """Random token ids ``[batch, length]`` (no 0, the padding id), on torch's default device
    (drawn on the CPU, so that every device gets the same ids)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=generator, device="cpu")
    return ids.to(torch.get_default_device())


def seeded(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on torch's default device, for random test tensors."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


#: a ChatML template (SmolLM2's, without its default system prompt)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def byte_tokenizer(chat_template: bool = True):
    """A fast tokenizer with one token per byte (ids 0-255), ChatML's special tokens after them
    and a ChatML chat template (none with ``chat_template=False``): a real
    ``PreTrainedTokenizerFast``, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in enumerate(_byte_level_alphabet())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE if chat_template else None
    return tokenizer


def _byte_level_alphabet() -> list[str]:
    """The character byte-level BPE (GPT-2's) shows for each byte: printable Latin-1 bytes as
    themselves, the others as the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def save_tiny_checkpoint(path, family: str = "llama", seed: int = 0, **fields):
    """A tiny random model and :func:`byte_tokenizer` saved in ``path`` (a local checkpoint that
    ``from_pretrained`` loads offline); returns ``path``."""
    tokenizer = byte_tokenizer()
    fields = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, **fields}
    fields.setdefault("pad_token_id", tokenizer.pad_token_id)
    model = tiny_model(family, seed=seed, key_scale=4.0, **fields)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
