"""The file a compressed context is saved to (:meth:`kvpatch.CompressedContext.save`) and
loaded from (:func:`kvpatch.load_context`).

The file is safetensors: the context's token ids, padding mask and last logits, and every
layer's held tensors (a buffer's spare room is not written), with a JSON header in its metadata
(format version, kvpatch version, policy, dtype, quantization, the model's fingerprint and a
checksum of the header and the tensors). Loading checks it against the model and the file before
anything is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from kvpatch import policies
from kvpatch.cache import CompressedDynamicCache, Quantization, serial
from kvpatch.compat import rotary_function
from kvpatch.files import checked_tensors, checksum, tensor_bytes
from kvpatch.policies import fitted_maps

FORMAT = "kvpatch-context"
FORMAT_VERSION = 1


def save(
    path: str | os.PathLike, model, cache, input_ids, attention_mask, logits, /, **extra: str
) -> None:
    """Write a context (``model``'s ``cache`` after ``input_ids``) to ``path``, replaced whole:
    a reader never sees half a file. ``extra`` strings go into the header (e.g. the ``--model``
    that loads it back)."""
    tensors, layers = serial.cache_state(cache, encode_policy)
    tensors["context.input_ids"] = input_ids
    tensors["context.attention_mask"] = attention_mask
    if logits is not None:
        tensors["context.logits"] = logits
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    budget = cache.decode_budget
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvpatch_version": _kvpatch_version(),
        "dtype": str(_model_dtype(model)).removeprefix("torch."),
        "policy": encode_policy(cache.policy),
        "quantization": None if cache.quantization is None else vars(cache.quantization),
        "decode_budget": None if budget is None else vars(budget),
        "sink_tokens": cache.sink_tokens,
        "max_kv_tokens": cache.max_kv_tokens,
        "model": fingerprint(model),
        "layers": layers,
        "extra": extra,
    }
    header["checksum"] = checksum(header, tensors)
    from safetensors.torch import save_file

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={"kvpatch": json.dumps(header)})
    os.replace(partial, path)


def read_header(path: str | os.PathLike) -> dict:
    """The header of a saved context (no tensor is read); a clear error for any other file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except FileNotFoundError:
        raise
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{path} is not a readable kvpatch context file ({error})") from None
    try:
        header = json.loads(metadata["kvpatch"])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path} is a safetensors file but not a kvpatch context") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a kvpatch context (format {header.get('format')!r})")
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is in context format {header.get('format_version')} (kvpatch "
            f"{header.get('kvpatch_version')}); this kvpatch reads format {FORMAT_VERSION}"
        )
    return header


def load(model: torch.nn.Module, path: str | os.PathLike):
    """``(cache, input_ids, attention_mask, logits)`` of the context :func:`save` wrote to
    ``path``, for ``model`` (the same weights, config and dtype as when it was saved)."""
    header = read_header(path)
    _check_model(header, model, path)
    tensors = checked_tensors(path, header, next(model.parameters()).device)
    cache = CompressedDynamicCache(
        config=model.config,
        policy=decode_policy(header["policy"]),
        decode_budget=(header["decode_budget"] or {}).get("tokens"),
        decode_interval=(header["decode_budget"] or {}).get("interval", 64),
        quantize=None if header["quantization"] is None else Quantization(**header["quantization"]),
        sink_tokens=header["sink_tokens"],
        max_kv_tokens=header.get("max_kv_tokens"),
    )
    serial.restore_layers(cache, header["layers"], tensors, decode_policy, rotary_function(model))
    for policy in [cache.policy, *(layer.policy for layer in cache.compressed_layers)]:
        if policy is not None:
            policy.prepare(model)  # e.g. a layer's hidden-state scorer reads its fitted map
    ids, mask = tensors["context.input_ids"], tensors["context.attention_mask"]
    return cache, ids, mask, tensors.get("context.logits")


def _check_model(header: dict, model: torch.nn.Module, path) -> None:
    dtype = str(_model_dtype(model)).removeprefix("torch.")
    if header["dtype"] != dtype:
        raise ValueError(
            f"{path} was saved from a {header['dtype']} model; this one is {dtype} (load the "
            f"model with dtype=torch.{header['dtype']})"
        )
    saved, current = header["model"], fingerprint(model)
    if saved["config"] != current["config"]:
        differ = sorted(
            key
            for key in saved["config"].keys() | current["config"].keys()
            if saved["config"].get(key) != current["config"].get(key)
        )
        raise ValueError(
            f"{path} was saved from another model: its config differs in {', '.join(differ[:8])}"
        )
    if saved["weights"] != current["weights"]:
        raise ValueError(f"{path} was saved from a model with other weights (same config)")


def fingerprint(model: torch.nn.Module) -> dict:
    """What identifies a model's computation: its config (without where it was loaded from) and
    a SHA-256 of its parameters."""
    weights = hashlib.sha256()
    for name, parameter in model.named_parameters():
        weights.update(name.encode())
        weights.update(tensor_bytes(parameter))
    return {"config": fitted_maps.computed_config(model), "weights": weights.hexdigest()}


def encode_policy(policy: policies.Policy | None):
    """A policy as JSON-able data: its class and the fields it was built with."""
    if policy is None:
        return None
    if not isinstance(policy, policies.Policy) or not dataclasses.is_dataclass(policy):
        raise serial.NotSaveable(f"cannot save the policy {policy!r}: not a dataclass Policy")
    fields = {}
    for field in dataclasses.fields(policy):
        if field.init:
            fields[field.name] = _encode_value(getattr(policy, field.name), field.name)
    return {"class": _class_name(type(policy)), "fields": fields}


def _encode_value(value, name: str):
    if isinstance(value, policies.Policy):
        return {"policy": encode_policy(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return {"list": [_encode_value(item, name) for item in value]}
    raise serial.NotSaveable(f"cannot save the policy field {name}={value!r}")


def decode_policy(data) -> policies.Policy | None:
    """The policy :func:`encode_policy` described (kvpatch's own classes and those already
    imported, never a module named by the file)."""
    if data is None:
        return None
    known = {_class_name(cls): cls for cls in _policy_classes()}
    cls = known.get(data.get("class"))
    if cls is None:
        raise ValueError(f"the saved policy class {data.get('class')!r} is not loaded here")
    return cls(**{name: _decode_value(value) for name, value in data["fields"].items()})


def _decode_value(value):
    if isinstance(value, dict) and "policy" in value:
        return decode_policy(value["policy"])
    if isinstance(value, dict) and "list" in value:
        return [_decode_value(item) for item in value["list"]]
    return value


def _policy_classes():
    """kvpatch's policies (imported on first use) and every subclass imported so far."""
    pending, seen = [policies.Policy, *policies.registry.policy_classes()], set()
    while pending:
        cls = pending.pop()
        if cls not in seen:
            seen.add(cls)
            pending.extend(cls.__subclasses__())
    return seen


def _class_name(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _kvpatch_version() -> str:
    return getattr(sys.modules.get("kvpatch"), "__version__", "unknown")
