"""A GGUF dequantized into a plain safetensors checkpoint and tokenizer (once per model)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from kvpatch.tools.demo.models import DemoModelUnavailable

#: written last by a conversion: a checkpoint directory without it is incomplete
MARKER = "kvpatch-converted.json"


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
    print(f"kvpatch.tools.demo: converting {gguf_path.name} to {out_dir} (once)", file=sys.stderr)
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
