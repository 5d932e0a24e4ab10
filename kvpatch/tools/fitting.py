"""Fit a hidden-state scorer's map (:class:`~kvpatch.policies.HiddenStateMap`) for a model:
``kvpatch fit-scorer``.

For each training document, the model prefills it (in the chat template's user turn, as the
pipeline renders a context) and the target policy reconstructs it
(:data:`~kvpatch.policies.registry.TARGET_POLICY`); the target of each (full-attention layer,
KV head, token) is the log of its score, the feature the hidden state that layer's attention read
for the token. Per layer, a closed-form ridge regression (``kind="linear"``; its strength chosen
on held-out text) or a two-layer MLP (``kind="mlp"``) maps features to targets. The leading
tokens every policy keeps anyway (the sinks, the chat template's preamble) are left out of the
fit.

Without training files, the model writes its own training text, sampled from
:data:`SEED_PROMPTS` (general prose: no planted facts, nothing built like the evaluation's
haystacks), so that fitting needs no data set and no network.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpatch import compat
from kvpatch.cache import CompressedDynamicCache, CompressedLayer
from kvpatch.feed import reconstruction
from kvpatch.patching import disable, enable, is_enabled
from kvpatch.pipeline import context_text
from kvpatch.policies import HiddenStateMap, TokenScorer, fitted_maps, parse_policy
from kvpatch.policies.registry import FIT_TARGETS, HIDDEN_STATE_POLICY, TARGET_POLICY
from kvpatch.tools.regression import (
    Moments,
    best_ridge,
    fit_mlp,
    mlp,
    r_squared,
    rank_correlation,
)
from kvpatch.tools.training_text import documents, sample_texts

#: the floor under the target's scores before their log (a token no query attends)
SCORE_FLOOR = 1e-9

Progress = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


@torch.no_grad()
def features_and_targets(
    model, tokenizer, document: str, target: TokenScorer | None = None
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """For one document: the full-attention layers, and per layer the hidden states ``[tokens,
    hidden]`` its attention read and the log target scores ``[tokens, kv_heads]``, the leading
    tokens every policy keeps left out."""
    target = target or parse_policy(TARGET_POLICY)
    declared = target.reconstruction
    before, _ = context_text(tokenizer, document)  # as `kvpatch compress` prefills it
    ids = tokenizer(before, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(next(model.parameters()).device)
    mask = torch.ones_like(ids)
    cache = CompressedDynamicCache(config=model.config, policy=target)
    hidden: dict[int, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(_recorder(hidden), with_kwargs=True)
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj")
    ]
    try:
        model(
            ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{compat.cache_argument(model): cache},
        )
    finally:
        for hook in hooks:
            hook.remove()
    prompts = reconstruction.Prompts(tokenizer, declared, ids.device, target.name)
    reconstruction.reconstruct(model, cache, ids, mask, prompts, declared)
    skip = max(declared.sinks, reconstruction.system_prefix_length(tokenizer, ids, mask))
    layers, xs, ys = [], [], []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, CompressedLayer) or layer.reconstruction_scores is None:
            continue
        layers.append(index)
        xs.append(hidden[index][0, skip:].float().cpu())
        scores = layer.reconstruction_scores[0, :, skip:].float().cpu()  # [kv_heads, tokens]
        ys.append(scores.clamp(min=SCORE_FLOOR).log().T.contiguous())
    return layers, xs, ys


def _recorder(store: dict[int, torch.Tensor]):
    def hook(module, args, kwargs):
        found = kwargs.get("hidden_states", args[0] if args else None)
        store.setdefault(module.layer_idx, found.detach())  # the prefill's, not later passes'

    return hook


@dataclass
class _Layer:
    """What one layer's fit reads: the training sums (and, for an MLP, the training tokens) and
    the held-out tokens."""

    moments: Moments = field(default_factory=Moments)
    train_x: list[torch.Tensor] = field(default_factory=list)
    train_y: list[torch.Tensor] = field(default_factory=list)
    test_x: list[torch.Tensor] = field(default_factory=list)
    test_y: list[torch.Tensor] = field(default_factory=list)


def fit_map(
    model,
    tokenizer,
    texts: list[str],
    kind: str = "linear",
    held_out: int = 1,
    width: int = 64,
    epochs: int = 300,
    progress: Progress = _quiet,
    target: str = TARGET_POLICY,
) -> tuple[HiddenStateMap, dict]:
    """Fit a map on ``texts`` (documents), the last ``held_out`` of them held out for the
    report, to the scores of ``target`` (a policy string naming a scorer that reconstructs the
    context, :data:`~kvpatch.policies.registry.FIT_TARGETS`). Returns the map and the report (per
    layer: R² and rank correlation on the held-out documents, the ridge strength; the tokens
    used; the target)."""
    if kind not in ("linear", "mlp"):
        raise ValueError(f"kind is 'linear' or 'mlp', got {kind!r}")
    scorer = reconstructing_scorer(target)
    if len(texts) <= held_out:
        raise ValueError(
            f"fitting needs more documents than the {held_out} held out, got {len(texts)}"
        )
    layers, per_layer = _collect(model, tokenizer, texts, held_out, kind == "mlp", progress, scorer)
    params, rows = [], []
    for index in layers:
        found, row = _fit_layer(per_layer[index], kind, width, epochs)
        params.append(found)
        rows.append({"layer": index, **row})
        progress(
            f"layer {index:3d}: held-out R2 {row['r2']:.3f}, rank correlation "
            f"{row['rank_correlation']:.3f}"
        )
    names = ("weight", "bias", "weight2", "bias2")[: len(params[0])]
    stacked = {name: torch.stack([p[k] for p in params]) for k, name in enumerate(names)}
    hidden_map = HiddenStateMap(kind, layers=list(layers), **stacked)
    report = {
        "kind": kind,
        "target": target,
        "documents": len(texts),
        "held_out": held_out,
        "training_tokens": per_layer[layers[0]].moments.n,
        "layers": rows,
        "mean_r2": round(sum(r["r2"] for r in rows) / len(rows), 4),
        "mean_rank_correlation": round(sum(r["rank_correlation"] for r in rows) / len(rows), 4),
    }
    return hidden_map, report


def reconstructing_scorer(target: str) -> TokenScorer:
    """The scorer a map is fitted to: ``target`` parsed, which must score tokens by
    reconstructing the context (its scores are what the fit reads)."""
    scorer = parse_policy(target)
    if not isinstance(scorer, TokenScorer) or scorer.reconstruction is None:
        raise ValueError(
            f"a map is fitted to the scores of a policy that reconstructs the context: "
            f"{' or '.join(map(repr, FIT_TARGETS))}, with settings if any; got {target!r}"
        )
    if scorer.keeps_everything:  # a layer kept whole is never scored
        raise ValueError(f"the fit's target must drop tokens (a ratio above 0), got {target!r}")
    return scorer


def _collect(model, tokenizer, texts, held_out, keep_tokens, progress, scorer):
    """Every document's features and targets, summed per layer (the last ``held_out`` kept
    apart); the layers in order and their :class:`_Layer`."""
    was_enabled = is_enabled(model)
    if not was_enabled:
        enable(model)
    per_layer: dict[int, _Layer] = {}
    layers: list[int] = []
    try:
        for number, text in enumerate(texts):
            start = time.perf_counter()
            layers, xs, ys = features_and_targets(model, tokenizer, text, scorer)
            test = number >= len(texts) - held_out
            for index, x, y in zip(layers, xs, ys, strict=True):
                entry = per_layer.setdefault(index, _Layer())
                if test:
                    entry.test_x.append(x)
                    entry.test_y.append(y)
                    continue
                entry.moments.add(x, y)
                if keep_tokens:
                    entry.train_x.append(x)
                    entry.train_y.append(y)
            progress(
                f"document {number + 1}/{len(texts)} ({'held out' if test else 'training'}): "
                f"{xs[0].shape[0]} tokens scored by {scorer.name} in "
                f"{time.perf_counter() - start:.1f} s"
            )
    finally:
        if not was_enabled:
            disable(model)
    return layers, per_layer


def _fit_layer(entry: _Layer, kind: str, width: int, epochs: int):
    """One layer's map tensors and its held-out measures."""
    test_x, test_y = torch.cat(entry.test_x), torch.cat(entry.test_y).double()
    if kind == "linear":
        strength, weight, bias = best_ridge(entry.moments, test_x, test_y)
        predicted = test_x.double() @ weight + bias
        found = (weight.float(), bias.float())
    else:
        strength = None
        found = fit_mlp(torch.cat(entry.train_x), torch.cat(entry.train_y), width, epochs)
        predicted = mlp(test_x.float(), *found).double()
        found = tuple(p.detach().float() for p in found)
    row = {
        "r2": round(r_squared(predicted, test_y), 4),
        "rank_correlation": round(rank_correlation(predicted, test_y), 4),
        "ridge": strength,
    }
    return found, row


def run(args: argparse.Namespace) -> int:
    """Fit and write the map (the options of :mod:`kvpatch.tools.cli.fit_scorer`)."""
    from kvpatch.tools.loading import load_model

    say = lambda message: print(f"kvpatch fit-scorer: {message}", file=sys.stderr, flush=True)
    model, tokenizer = load_model(args.model, args.attn, args.dtype)
    if args.text_files:
        texts = [path.read_text() for path in args.text_files]
    else:
        written = sample_texts(model, tokenizer, args.samples, args.sample_tokens, progress=say)
        texts = documents(written, args.per_document)
    hidden_map, report = fit_map(
        model,
        tokenizer,
        texts,
        kind=args.kind,
        held_out=args.held_out,
        progress=say,
        target=args.target,
    )
    out = args.out or fitted_maps.default_path(model)
    fitted_maps.save_map(out, hidden_map, model, report)
    print(
        f"{HIDDEN_STATE_POLICY} map ({args.kind}, {len(hidden_map.layers)} layers, held-out R2 "
        f"{report['mean_r2']:.3f}, rank correlation {report['mean_rank_correlation']:.3f}) "
        f"written to {out}"
    )
    return 0
