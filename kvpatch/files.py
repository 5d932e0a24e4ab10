"""kvpatch's files: where they are kept (the demo models, the fitted maps of hidden-state
scorers), and the checksum that tells a damaged one (saved contexts, fitted maps)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


def cache_dir() -> Path:
    """``$KVPATCH_CACHE``, else ``$XDG_CACHE_HOME/kvpatch``, else ``~/.cache/kvpatch``."""
    if os.environ.get("KVPATCH_CACHE"):
        return Path(os.environ["KVPATCH_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvpatch"


def checksum(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the header (but its checksum) and of every tensor's name, shape and bytes."""
    digest = hashlib.sha256()
    described = {k: v for k, v in header.items() if k != "checksum"}
    digest.update(json.dumps(described, sort_keys=True).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(str(tuple(tensors[name].shape)).encode())
        digest.update(tensor_bytes(tensors[name]))
    return digest.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, in row-major order, whatever its dtype and device."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def checked_tensors(
    path: str | os.PathLike, header: dict, device: torch.device
) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``path``, on ``device``, if they and ``header``
    match the checksum it was saved with; a ValueError for a damaged file."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if checksum(header, tensors) != header.get("checksum"):
        raise ValueError(
            f"{path} is damaged: its header and tensors do not match the checksum it was saved with"
        )
    return {name: t.to(device) for name, t in tensors.items()}
