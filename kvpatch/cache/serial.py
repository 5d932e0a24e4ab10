"""A filled cache as named tensors and a JSON-able description of each layer, and back.

:mod:`kvpatch.saving` writes the two into one safetensors file. Only what the cache holds is
written (a buffer's spare room is not), and nothing is recomputed on the way back: the restored
cache holds the same tensors, so it gives the same logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from kvpatch import compat
from kvpatch.cache.budget import DecodeBudget
from kvpatch.cache.buffer import GrowingBuffer
from kvpatch.cache.dynamic import CompressedDynamicCache
from kvpatch.cache.layer import CompressedLayer
from kvpatch.cache.lifecycle import Phase
from kvpatch.cache.packed import PackedKV
from kvpatch.cache.quantized import Quantization, QuantizedRows
from kvpatch.cache.recompress import LayerSetup
from kvpatch.cache.store import CompressedStore

Tensors = dict[str, torch.Tensor]


class NotSaveable(ValueError):
    """The cache is in a state that cannot be written (e.g. mid-compression)."""


def cache_state(cache: CompressedDynamicCache, encode_policy) -> tuple[Tensors, list[dict]]:
    """Every layer's tensors (keys ``layers.I.NAME``) and its description."""
    tensors: Tensors = {}
    layers = []
    for index, layer in enumerate(cache.layers):
        own: Tensors = {}
        if isinstance(layer, CompressedLayer):
            described = _compressed_layer_state(layer, own, encode_policy)
        elif isinstance(layer, DynamicLayer):  # sliding-window layers included
            described = _dynamic_layer_state(layer, own)
        else:
            raise NotSaveable(
                f"layer {index} is a {type(layer).__name__}, which kvpatch cannot save"
            )
        tensors.update({f"layers.{index}.{name}": t.contiguous() for name, t in own.items()})
        layers.append(described)
    return tensors, layers


def restore_layers(
    cache: CompressedDynamicCache,
    layers: list[dict],
    tensors: Tensors,
    decode_policy,
    rotary: Callable | None,
) -> None:
    """Fill the layers of a new ``cache`` (made for the same model) from :func:`cache_state`."""
    if len(layers) != len(cache.layers):
        raise ValueError(
            f"the saved cache has {len(layers)} layers, this model's has {len(cache.layers)}"
        )
    for index, (layer, described) in enumerate(zip(cache.layers, layers, strict=True)):
        own = {
            name.split(".", 2)[2]: t
            for name, t in tensors.items()
            if name.startswith(f"layers.{index}.")
        }
        if described["kind"] == "compressed" and not isinstance(layer, CompressedLayer):
            raise ValueError(f"layer {index} was saved compressed but this model's is not")
        if described["kind"] == "compressed":
            _restore_compressed(layer, described, own, decode_policy, rotary)
        elif described["kind"] != "empty":
            _restore_dense(layer, described, own)


def _dynamic_layer_state(layer: DynamicLayer, own: Tensors) -> dict:
    if not compat.layer_is_initialized(layer) or layer.keys is None:
        return {"kind": "empty"}
    own["keys"], own["values"] = layer.keys, layer.values
    extra = {name: getattr(layer, name) for name in ("cumulative_length",) if hasattr(layer, name)}
    return {"kind": "dense", "attributes": _plain(extra)}


def _compressed_layer_state(layer: CompressedLayer, own: Tensors, encode_policy) -> dict:
    if layer.phase in (Phase.PREFILLED, Phase.WAITING, Phase.RECONSTRUCTING):
        raise NotSaveable("a layer is still waiting for its compression; save a prefilled context")
    if layer.store is None:
        state = _dynamic_layer_state(layer, own)
        if state["kind"] == "dense":
            state["attributes"] = {"seen": layer.seen, "passthrough": layer.phase is Phase.DENSE}
        return state
    store, setup = layer.store, layer.setup
    own.update(_packed_tensors(store.packed))
    # the buffers' held positions: the tail, after the packed tokens where those are stored dense
    own["tail_keys"], own["tail_values"] = store.keys.view(), store.values.view()
    own["tail_valid"], own["position_offset"] = store.tail_valid, setup.position_offset
    if layer.recent_queries is not None:
        own["recent_queries"] = layer.recent_queries
    if layer.token_scores is not None:
        own["token_scores"] = layer.token_scores
    packed = store.packed
    quantization = store.quantization
    return {
        "kind": "compressed",
        "seen": layer.seen,
        "tail_start": store.tail_start,
        "reserve": store.keys.reserve,
        "quantization": None if quantization is None else vars(quantization),
        "packed": {
            "head_dim": packed.head_dim,
            "value_dim": packed.value_dim,
            "keys": _rows_kind(packed.keys),
            "values": _rows_kind(packed.values),
        },
        "setup": {
            "policy": encode_policy(setup.policy),
            "scaling": setup.scaling,
            "layer_idx": setup.layer_idx,
            "decode_budget": None if setup.decode_budget is None else vars(setup.decode_budget),
            "sink_tokens": setup.sink_tokens,
        },
    }


def _packed_tensors(packed: PackedKV) -> Tensors:
    own = {"lengths": packed.lengths, "record": packed.record}
    for name in ("channels", "value_channels"):
        if getattr(packed, name) is not None:
            own[name] = getattr(packed, name)
    for name in ("keys", "values"):
        rows = getattr(packed, name)
        if isinstance(rows, QuantizedRows):
            own.update({f"{name}.codes": rows.codes, f"{name}.scale": rows.scale})
            own[f"{name}.offset"] = rows.offset
        elif rows is not None:
            own[name] = rows
    return own


def _rows_kind(rows) -> dict | None:
    """How packed keys or values are stored: None (kept with the tail), plain, or quantized."""
    if rows is None:
        return None
    if isinstance(rows, QuantizedRows):
        return {"bits": rows.bits, "width": rows.width, "group": rows.group}
    return {}


def _rows(name: str, kind: dict | None, own: Tensors):
    if kind is None:
        return None
    if not kind:
        return own[name]
    parts = {part: own[f"{name}.{part}"] for part in ("codes", "scale", "offset")}
    return QuantizedRows(**parts, bits=kind["bits"], width=kind["width"], group=kind["group"])


def _restore_compressed(layer: CompressedLayer, described: dict, own, decode_policy, rotary):
    saved = described["packed"]
    packed = PackedKV(
        keys=_rows("keys", saved["keys"], own),
        values=_rows("values", saved["values"], own),
        lengths=own["lengths"],
        channels=own.get("channels"),
        record=own["record"],
        head_dim=saved["head_dim"],
        value_dim=saved["value_dim"],
        value_channels=own.get("value_channels"),
    )
    store = CompressedStore.__new__(CompressedStore)  # the saved parts as they are, not re-packed
    quantization = described["quantization"]
    store.quantization = None if quantization is None else Quantization(**quantization)
    store.packed = packed
    store.keys = GrowingBuffer.copy_of(own["tail_keys"], described["reserve"])
    store.values = GrowingBuffer.copy_of(own["tail_values"], described["reserve"])
    store.tail_start, store.tail_valid = described["tail_start"], own["tail_valid"]
    store._norm_bound, store._bounded = None, 0
    setup = described["setup"]
    budget = setup["decode_budget"]
    layer.setup = LayerSetup(
        policy=decode_policy(setup["policy"]),
        scaling=setup["scaling"],
        layer_idx=setup["layer_idx"],
        rotary=rotary,
        position_offset=own["position_offset"],
        decode_budget=None if budget is None else DecodeBudget(**budget),
        sink_tokens=setup["sink_tokens"],
    )
    tail = own["tail_keys"]
    layer.dtype, layer.device, layer.is_initialized = tail.dtype, tail.device, True
    layer.store, layer.seen = store, described["seen"]
    layer.lifecycle.move(Phase.COMPRESSED)
    layer.recent_queries = own.get("recent_queries")
    layer.token_scores = own.get("token_scores")
    if layer.token_scores is not None:
        layer.hidden_scorer = layer.setup.policy.hidden_state_scorer


def _restore_dense(layer: DynamicLayer, described: dict, own: Tensors) -> None:
    keys = own["keys"]  # set as lazy_initialization would (its signature varies by release)
    layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
    layer.keys, layer.values = keys, own["values"]
    attributes = dict(described.get("attributes", {}))
    if attributes.pop("passthrough", False):  # a CompressedLayer kept dense
        layer.lifecycle.move(Phase.DENSE)
    for name, value in attributes.items():
        setattr(layer, name, value)


def _plain(values: dict) -> dict:
    """Attributes as JSON-able numbers (a tensor of one element becomes its value)."""
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
