"""A compressed cache under ``torch.export`` and ``torch.compile``.

Export runs as transformers' own ``test_torch_export_generate`` does: ``generate`` on the enabled
model, its prefill and first decode step captured (``decompose_prefill_decode``) and each exported
with dynamic shapes (``DynamoExporter``, which flattens the cache's state into plain data and
tensors and rebuilds it); the exported programs must give the eager forward's logits.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kvpatch
from kvpatch import CompressedDynamicCache, compat
from kvpatch.cache.lifecycle import Phase
from kvpatch.patching import policy_of
from kvpatch.tools.testing import byte_tokenizer, random_prompt, tiny_model

#: the families transformers' export test was run on with kvpatch enabled, one policy each; then
#: every kind of policy on one family
CASES = [(family, "snapkv:0") for family in ("llama", "qwen2", "qwen3", "gemma3", "phi3", "olmo2")]
CASES += [("llama", p) for p in ("ada-snapkv:0", "think:0+snapkv:0", "global-kvzip:0")]


def export_and_run(model, inputs: dict):
    from transformers.exporters.configs import DynamoConfig
    from transformers.exporters.exporter_dynamo import DynamoExporter

    inputs = copy.deepcopy(inputs)  # the exporter takes the output flags (use_cache, ...) out
    program, _ = DynamoExporter().export_program(model, inputs, DynamoConfig(dynamic=True))
    with torch.no_grad():
        return program.module()(**copy.deepcopy(inputs))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "policy"), CASES)
def test_exported_prefill_and_decode_give_the_eager_logits(family, policy):
    pytest.importorskip("transformers.exporters", reason="transformers' exporters came in 5.x")
    from transformers.exporters.utils import decompose_prefill_decode

    model = tiny_model(family)
    ids = random_prompt(12, batch=2)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        stages = decompose_prefill_decode(model, inputs)
        decode_cache = stages["decode"][1][compat.cache_argument(model)]
        assert isinstance(decode_cache, CompressedDynamicCache)  # kvpatch's cache was exported
        for name, (stage_model, stage_inputs) in stages.items():
            with torch.no_grad():
                eager = stage_model(**copy.deepcopy(stage_inputs))
            exported = export_and_run(stage_model, stage_inputs)
            torch.testing.assert_close(exported.logits, eager.logits, msg=name)


def test_a_ratio_zero_policy_keeps_its_layers_dense():
    """What makes a ratio-0 forward exportable: nothing is planned or packed, the layers stay
    plain dense layers, decided from the settings alone."""
    model = tiny_model()
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, "think:0+snapkv:0"), torch.no_grad():
        model(random_prompt(20), use_cache=True, **{compat.cache_argument(model): cache})
    assert {layer.phase for layer in cache.compressed_layers} == {Phase.DENSE}


#: what a compiled decode step reads: dense uniform heads (snapkv), packed heads read in place
#: (ada-snapkv), pruned channels (think), a padded view with per-head masks and sliding layers
#: (eager attention, Gemma 3), integer codes, a reconstruction's budgets
COMPILED = [
    ("llama", "sdpa", "snapkv:0.5", {}),
    ("llama", "sdpa", "ada-snapkv:0.5", {}),
    ("qwen3", "sdpa", "think:0.5+ada-snapkv:0.5", {}),
    ("gemma3", "eager", "think:0.5+ada-snapkv:0.5", {}),
    ("llama", "sdpa", "ada-snapkv:0.5", {"quantize": "int4"}),
    ("llama", "eager", "think:0.5+global-kvzip:0.5", {}),
]


def greedy_steps(model, forward, cache, prompt, steps: int):
    """``steps`` greedy decode steps of ``forward`` after an eager prefill of ``prompt`` into
    ``cache``. Returns the tokens, the graph breaks torch.compile met in each step and whether a
    layer packed a new layout in it (compressed again)."""
    from torch._dynamo.utils import counters

    argument = {compat.cache_argument(model): cache}
    with torch.no_grad():
        if policy_of(model).reconstruction is not None:  # a prefill that reconstructs
            context = kvpatch.prefill(
                model, prompt[:, :-1], tokenizer=byte_tokenizer(chat_template=False)
            )
            cache = context.cache
            argument = {compat.cache_argument(model): cache}
            logits = model(prompt[:, -1:], use_cache=True, **argument).logits
        else:
            logits = model(prompt, use_cache=True, **argument).logits
        tokens, breaks, repacked = [int(logits[0, -1].argmax())], [], []
        for _ in range(steps):
            before = sum(counters["graph_break"].values())
            stores = [layer.store for layer in cache.compressed_layers]
            logits = forward(torch.tensor([[tokens[-1]]]), use_cache=True, **argument).logits
            tokens.append(int(logits[0, -1].argmax()))
            breaks.append(sum(counters["graph_break"].values()) - before)
            now = [layer.store for layer in cache.compressed_layers]
            repacked.append(any(a is not b for a, b in zip(stores, now, strict=True)))
    assert all(layer.is_compressed for layer in cache.compressed_layers)
    return tokens, breaks, repacked


@pytest.mark.parametrize(("family", "attention", "policy", "options"), COMPILED)
def test_a_compiled_decode_step_has_no_graph_break(family, attention, policy, options):
    """16 decode steps of torch.compile (its graph capture; the eager backend runs the graphs)
    on a compressed cache: the eager tokens, no step falls out of the graph, and the graphs are
    captured once, not at every step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(family, attention, key_scale=4.0)
    prompt = random_prompt(60)
    with kvpatch.enabled(model, policy, tokenizer=byte_tokenizer(chat_template=False)):
        make = lambda: CompressedDynamicCache(config=model.config, **options)
        eager = greedy_steps(model, model, make(), prompt, 16)[0]
        tokens, breaks, _ = greedy_steps(
            model, torch.compile(model, backend="eager"), make(), prompt, 16
        )
    assert tokens == eager
    assert breaks == [0] * 16
    # captured (not skipped for eager), and recompiled at most for the first dynamic shapes
    assert 0 < counters["stats"]["unique_graphs"] <= 8


def test_a_decode_budget_leaves_the_graph_only_where_it_compresses():
    """Compressing again while decoding packs a new layout (its shapes come from what is kept):
    the steps that do so leave the graph, the others stay in it."""
    torch._dynamo.reset()
    model = tiny_model(key_scale=4.0)
    prompt = random_prompt(60)
    with kvpatch.enabled(model, "ada-snapkv:0.5/window=8"):
        make = lambda: CompressedDynamicCache(
            config=model.config, decode_budget=40, decode_interval=16
        )
        eager = greedy_steps(model, model, make(), prompt, 48)[0]
        tokens, breaks, repacked = greedy_steps(
            model, torch.compile(model, backend="eager"), make(), prompt, 48
        )
    assert tokens == eager
    compressing = {step for step, again in enumerate(repacked) if again}
    assert compressing, "the budget never compressed: the test would measure nothing"
    assert {step for step, count in enumerate(breaks) if count} <= compressing
    assert sum(breaks) > 0  # a compression step does leave the graph (else the test is blind)


@pytest.mark.slow
def test_an_inductor_compiled_decode_gives_the_eager_tokens():
    """The same through inductor, which generates and runs its own kernels."""
    torch._dynamo.reset()
    model = tiny_model(key_scale=4.0)
    prompt = random_prompt(40)
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.5"):
        make = lambda: CompressedDynamicCache(config=model.config)
        eager = greedy_steps(model, model, make(), prompt, 16)[0]
        compiled = torch.compile(model, backend="inductor")
        tokens, breaks, _ = greedy_steps(model, compiled, make(), prompt, 16)
    assert tokens == eager
    assert breaks == [0] * 16
