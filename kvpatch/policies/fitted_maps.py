"""Fitted hidden-state maps (:class:`HiddenStateMap`) and their files: written by ``kvpatch
fit-scorer``, read when a ``kvzap`` policy meets its model.

A file is safetensors: the map's tensors and a JSON
header with the format version, the map's kind and layers, the fit's report, the model's identity
(its config and a SHA-256 of its weights as bfloat16, so that one file serves the model in any
dtype) and a SHA-256 of the header and the tensors. A file is refused, with the reason, for
another model, when damaged or truncated, or when written by a newer format.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvpatch.files import cache_dir, checked_tensors, checksum

#: the kinds of map: a linear layer per model layer, or a two-layer MLP per model layer
MAP_KINDS = ("linear", "mlp")


@dataclass
class HiddenStateMap:
    """Per model layer, a map from a hidden state ``[..., hidden]`` to one log-score per KV head
    ``[..., kv_heads]``.

    Attributes
    ----------
    kind : ``"linear"`` (``h @ weight + bias``) or ``"mlp"`` (``gelu(h @ weight + bias) @ weight2
        + bias2``).
    weight : ``[layers, hidden, kv_heads]`` (linear) or ``[layers, hidden, width]`` (mlp).
    bias : ``[layers, kv_heads]`` or ``[layers, width]``.
    weight2, bias2 : the MLP's second layer, ``[layers, width, kv_heads]`` and ``[layers,
        kv_heads]``; None for a linear map.
    layers : the model layers the map covers (its full-attention layers), in the order of the
        tensors' first dimension.
    """

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor
    layers: list[int]
    weight2: torch.Tensor | None = None
    bias2: torch.Tensor | None = None
    _row: dict[int, int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in MAP_KINDS:
            raise ValueError(f"a map's kind is one of {MAP_KINDS}, got {self.kind!r}")
        if (self.weight2 is None) != (self.kind == "linear"):
            raise ValueError("a linear map has one layer of weights, an MLP two")
        self._row = {layer: row for row, layer in enumerate(self.layers)}

    @property
    def kv_heads(self) -> int:
        return (self.weight if self.weight2 is None else self.weight2).shape[-1]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The map's tensors by name (what a file stores)."""
        named = {"weight": self.weight, "bias": self.bias}
        if self.weight2 is not None:
            named |= {"weight2": self.weight2, "bias2": self.bias2}
        return named

    def score(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Log-scores ``[batch, kv_heads, tokens]`` of hidden states ``[batch, tokens, hidden]``
        of layer ``layer_idx``."""
        row = self._row.get(layer_idx)
        if row is None:
            raise ValueError(
                f"this map covers layers {self.layers}, not layer {layer_idx}: it was "
                "fitted for another model"
            )
        x = hidden.to(self.weight.dtype)
        out = x @ self.weight[row].to(x.device) + self.bias[row].to(x.device)
        if self.weight2 is not None:
            out = torch.nn.functional.gelu(out) @ self.weight2[row].to(x.device)
            out = out + self.bias2[row].to(x.device)
        return out.transpose(-1, -2)

    def to(self, device: torch.device | str) -> HiddenStateMap:
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return HiddenStateMap(self.kind, layers=self.layers, **moved)


FORMAT = "kvpatch-kvzap"
FORMAT_VERSION = 1
#: config entries that say how a model was loaded or what a call returns, not what it computes
_CONFIG_NOISE = {
    "transformers_version",
    "dtype",
    "torch_dtype",
    "architectures",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
}

_identities: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()


def computed_config(model: torch.nn.Module) -> dict:
    """The entries of ``model``'s config that say what it computes (not where or how it was
    loaded, nor what a call returns; private entries left out), as JSON values."""
    config = {
        k: v
        for k, v in model.config.to_dict().items()
        if k not in _CONFIG_NOISE and not k.startswith("_")
    }
    return json.loads(json.dumps(config, sort_keys=True, default=str))


def identity(model: torch.nn.Module) -> dict:
    """The model's config (without load paths and call flags) and a SHA-256 of its weights as
    bfloat16; computed once per model object (about a second per 500 MB of weights)."""
    found = _identities.get(model)
    if found is not None:
        return found
    weights = hashlib.sha256()
    for name, parameter in model.named_parameters():
        weights.update(name.encode())
        data = parameter.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
        weights.update(data.numpy().tobytes())
    found = {"config": computed_config(model), "weights": weights.hexdigest()}
    _identities[model] = found
    return found


def model_key(model: torch.nn.Module) -> str:
    """A short hex name of :func:`identity`, for file names."""
    return hashlib.sha256(json.dumps(identity(model), sort_keys=True).encode()).hexdigest()[:16]


def default_path(model: torch.nn.Module) -> Path:
    """Where ``fit-scorer`` writes the model's map, and where ``kvzap`` looks for it."""
    kind = getattr(model.config, "model_type", "model")
    return cache_dir() / "scorers" / f"kvzap-{kind}-{model_key(model)}.safetensors"


def save_map(
    path: str | os.PathLike, hidden_map: HiddenStateMap, model: torch.nn.Module, report: dict
) -> Path:
    """Write ``hidden_map`` (fitted on ``model``, ``report`` its fit) to ``path``, replaced
    whole: a reader never sees half a file."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in hidden_map.tensors().items()}
    header = {
        "format_version": FORMAT_VERSION,
        "kvpatch_version": getattr(sys.modules.get("kvpatch"), "__version__", "unknown"),
        "kind": hidden_map.kind,
        "layers": hidden_map.layers,
        "model": identity(model),
        "fit": report,
    }
    header["checksum"] = checksum(header, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={"format": FORMAT, "header": json.dumps(header)})
    partial.replace(path)
    return path


def load_map(path: str | os.PathLike, model: torch.nn.Module) -> HiddenStateMap:
    """The map in ``path``, checked against ``model`` and against its own checksum."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"no fitted kvzap map at {path}: fit one for this model first with\n"
            "    kvpatch fit-scorer --model MODEL   (or kvpatch.tools.fitting.fit_map)\n"
            "or give its file as KVzap(path=...) / 'kvzap/path=FILE'"
        )
    header = _read_header(path)
    _check_model(header, model, path)
    tensors = checked_tensors(path, header, next(model.parameters()).device)
    return HiddenStateMap(header["kind"], layers=list(header["layers"]), **tensors)


def _read_header(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:  # truncated, or not safetensors at all
        raise ValueError(f"{path} is not a readable kvzap map file ({error})") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a kvzap map written by kvpatch fit-scorer")
    try:
        header = json.loads(metadata["header"])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path} is damaged: its header cannot be read") from None
    version = header.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {version!r}; this kvpatch reads up to {FORMAT_VERSION}: "
            "upgrade kvpatch or fit the map again"
        )
    return header


def _check_model(header: dict, model: torch.nn.Module, path: Path) -> None:
    saved, current = header.get("model", {}), identity(model)
    if saved.get("config") != current["config"]:
        differ = sorted(
            key
            for key in saved.get("config", {}).keys() | current["config"].keys()
            if saved.get("config", {}).get(key) != current["config"].get(key)
        )
        raise ValueError(
            f"{path} was fitted for another model: its config differs in {', '.join(differ[:8])}"
            "; fit a map for this one with kvpatch fit-scorer"
        )
    if saved.get("weights") != current["weights"]:
        raise ValueError(
            f"{path} was fitted for a model with other weights (same config); fit a map for this "
            "one with kvpatch fit-scorer"
        )
