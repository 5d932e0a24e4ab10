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


@pytest.mark.slow
def test_a_compiled_decode_step_gives_the_eager_tokens():
    """16 greedy decode steps of ``torch.compile`` (inductor) on a compressed cache: the tokens
    of the eager decode."""
    model = tiny_model(key_scale=4.0)
    prompt = random_prompt(40)

    def decode(forward) -> list[int]:
        cache = CompressedDynamicCache(config=model.config)
        argument = {compat.cache_argument(model): cache}
        with torch.no_grad():
            logits = model(prompt, use_cache=True, **argument).logits  # the prefill, eager
            tokens = [int(logits[0, -1].argmax())]
            for _ in range(15):
                step = torch.tensor([[tokens[-1]]])
                logits = forward(step, use_cache=True, **argument).logits
                tokens.append(int(logits[0, -1].argmax()))
        assert cache.compressed_layers[0].phase is Phase.COMPRESSED
        return tokens

    with kvpatch.enabled(model, "snapkv:0.5"):
        eager = decode(model)
        compiled = decode(torch.compile(model, backend="inductor"))
    assert compiled == eager
