"""Defects transformers' own tests found with kvpatch enabled at ratio 0, each reproduced here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvpatch import compat


def test_importing_inside_a_meta_device_context_leaves_generate_working():
    """``from_pretrained`` runs code under ``torch.device("meta")``; kvpatch imported there for
    the first time must build no tensor that later generation uses."""
    code = textwrap.dedent(
        """
        import torch
        with torch.device("meta"):
            import kvpatch
        from kvpatch.tools.testing import random_prompt, tiny_model
        model = tiny_model()
        ids = random_prompt(200)
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with kvpatch.enabled(model, "snapkv:0"):
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            kept = kvpatch.prefill(model, ids, policy="snapkv:0.5").cache.stats()
        assert torch.equal(out, expected)
        assert kept.layers[0].kept is not None
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_a_cache_implementation_on_the_generation_config_is_used_without_a_policy():
    """Enabled without a policy, kvpatch adds no cache of its own where the model's generation
    config asks for another: generation is the stock one."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model()
    model.generation_config.cache_implementation = "static"
    ids = random_prompt(20)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)


def _padded(kind: str):
    import torch

    from kvpatch.tools.testing import random_prompt

    ids = random_prompt(100, batch=2)
    mask = torch.ones_like(ids)
    if kind == "left":
        mask[0, :7] = 0
    elif kind == "right":
        mask[0, -5:] = 0
    else:  # padding every row shares
        mask[:, :3] = 0
    return ids, mask


def _generate_attentions(model, ids, mask):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
        output_attentions=True,
        return_dict_in_generate=True,
    )


@pytest.mark.parametrize("padding", ["left", "right", "shared"])
def test_decode_attention_weights_are_laid_out_as_stock(padding):
    """``output_attentions`` gives weights over the logical positions: at ratio 0 those of the
    unpatched model; compressed, zero at every evicted position and summing to one."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import tiny_model

    model = tiny_model(attn_implementation="eager", key_scale=4.0)
    ids, mask = _padded(padding)
    stock = _generate_attentions(model, ids, mask)
    with kvpatch.enabled(model, "snapkv:0"):
        same = _generate_attentions(model, ids, mask)
    assert torch.equal(same.sequences, stock.sequences)
    for a, b in zip(stock.attentions, same.attentions, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5)
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        compressed = _generate_attentions(model, ids, mask)
    layers = kvpatch.compat.cache_of(compressed).stats().layers
    for step, attentions in enumerate(compressed.attentions[1:], start=1):
        for layer, weights in zip(layers, attentions, strict=True):
            assert weights.shape[-1] == ids.shape[1] + step  # every logical position
            torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
            held = layer.kept[..., : ids.shape[1]]  # what the prefill kept, per KV head
            group = weights.shape[1] // held.shape[1]
            evicted = ~held.repeat_interleave(group, 1)[:, :, None, :].expand(
                -1, -1, weights.shape[2], -1
            )
            assert evicted.any()
            assert (weights[..., : ids.shape[1]][evicted] == 0).all()


def test_the_model_config_stays_the_stock_one():
    """enable changes no config a model may share: ``output_attentions`` can be set on it, a
    second model built from it runs stock, and switching the config's implementation does not
    stop the enabled model from compressing."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model(attn_implementation="eager", key_scale=4.0)
    ids = random_prompt(120)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    def logits(model):
        out = model.generate(
            ids,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return torch.stack(out.logits)

    sdpa_model = tiny_model(attn_implementation="sdpa", key_scale=4.0)  # the same weights
    with kvpatch.enabled(sdpa_model, "snapkv:0.5"):
        sdpa_compressed = logits(sdpa_model)
    with kvpatch.enabled(model, "snapkv:0.5"):
        model.config.output_attentions = True  # raised "not supported ... kvpatch_eager"
        model.config.output_attentions = False
        twin = type(model)(model.config).eval()
        twin.load_state_dict(model.state_dict())
        assert torch.equal(
            twin.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), expected
        )
        # as transformers' tests do: the masks are then sdpa's (none where causal can be
        # skipped), and the kernel follows, compressing as before
        model.config._attn_implementation = "sdpa"
        torch.testing.assert_close(logits(model), sdpa_compressed, atol=1e-4, rtol=0)
        out = model.generate(
            ids, max_new_tokens=1, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
        assert kvpatch.compat.cache_of(out).stats().layers[0].compressed


ASSISTANTS = {
    "draft model": lambda: {"assistant_model": _draft()},
    "prompt lookup": lambda: {"prompt_lookup_num_tokens": 3},
}


def _draft():
    from kvpatch.tools.testing import tiny_model

    return tiny_model(seed=5, key_scale=4.0)


@pytest.mark.parametrize("length", [1, 2, 9, 40, 300])
@pytest.mark.parametrize("assistant", list(ASSISTANTS))
def test_assisted_decoding_at_every_prompt_length(assistant, length):
    """The first verification forward holds the prompt and the candidates: only the prompt is
    compressed, so rejected candidates are tail tokens that can be cropped. At ratio 0 the
    tokens are the unpatched model's; compressed, generation runs and the cache holds the
    prompt's budget plus what was accepted."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model(key_scale=4.0)
    half = random_prompt(length // 2 + 1, seed=3)
    ids = torch.cat([half, half], 1)[:, :length]  # repeats, so that prompt lookup finds some
    # prompt lookup needs an end token before transformers 4.57; min_new_tokens keeps it away
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    kwargs.update(eos_token_id=model.config.vocab_size - 1, **ASSISTANTS[assistant]())
    stock = model.generate(ids, **kwargs)
    with kvpatch.enabled(model, "ada-snapkv:0"):
        assert torch.equal(model.generate(ids, **kwargs), stock)
    with kvpatch.enabled(model, "snapkv:0.5"):
        out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    assert out.sequences.shape[1] == length + 10
    held = kvpatch.compat.cache_of(out).physical_lengths()[0]
    budget = max(length - length // 2, min(length, 68))  # the prompt's: window and sinks
    if length > 1:
        assert (held == budget + 10 - 1).all()  # and every token generated but the last


DYNAMIC_REQUESTS = {
    "argument": lambda model, name: {"cache_implementation": name},
    "generation_config argument": lambda model, name: {
        "generation_config": _generation_config(model, cache_implementation=name)
    },
    "model's generation_config": lambda model, name: _on_the_model(model, name),
}


def _generation_config(model, **changes):
    import copy

    config = copy.deepcopy(model.generation_config)
    config.update(**changes)
    return config


def _on_the_model(model, name):
    model.generation_config.cache_implementation = name
    return {}


@pytest.mark.parametrize("where", list(DYNAMIC_REQUESTS))
@pytest.mark.parametrize("name", compat.DYNAMIC_CACHE_IMPLEMENTATIONS)
def test_a_dynamic_cache_implementation_gets_the_compressed_cache(name, where):
    """``cache_implementation="dynamic"`` or ``"dynamic_full"`` (transformers' tests ask for the
    latter with assisted decoding) is a growing cache, which kvpatch's is: generation compresses
    as without it, and ``dynamic_full`` makes sliding-window layers full attention as it does in
    transformers. No generation config is changed."""
    import torch

    import kvpatch
    from kvpatch.cache import CompressedLayer
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model("gemma2", "eager", key_scale=4.0)
    ids = random_prompt(200)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    stock = model.generate(ids, **kwargs, **DYNAMIC_REQUESTS[where](model, name)).sequences
    model.generation_config.cache_implementation = None
    with kvpatch.enabled(model, "snapkv:0.5"):
        plain = model.generate(ids, **kwargs)
        asked = model.generate(ids, **kwargs, **DYNAMIC_REQUESTS[where](model, name))
        assert model.generation_config.cache_implementation == (
            name if where == "model's generation_config" else None
        )
        model.generation_config.cache_implementation = None
    with kvpatch.enabled(model, "snapkv:0"):
        unchanged = model.generate(ids, **kwargs, **DYNAMIC_REQUESTS[where](model, name))
        model.generation_config.cache_implementation = None
    assert torch.equal(unchanged.sequences, stock)
    cache, layers = kvpatch.compat.cache_of(asked), kvpatch.compat.cache_of(asked).layers
    assert cache.stats().layers[-1].compressed  # a full-attention layer
    all_full = all(isinstance(layer, CompressedLayer) for layer in layers)
    assert all_full == (name == "dynamic_full")
    if name == "dynamic":
        assert torch.equal(asked.sequences, plain.sequences)


@pytest.mark.parametrize("policy", ["snapkv:0", "ada-snapkv:0", "think:0+snapkv:0"])
def test_a_layers_keys_at_ratio_0_are_a_dynamic_caches(policy):
    """transformers' tests read ``layer.keys``/``values`` of the cache generate returns: at ratio
    0 they are the stock cache's, every token of every head (each layer kept whole, a plain dense
    layer: nothing is planned or packed)."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model(key_scale=4.0)
    ids = random_prompt(90, batch=2)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    stock = kvpatch.compat.cache_of(model.generate(ids, **kwargs))
    with kvpatch.enabled(model, policy):
        ours = kvpatch.compat.cache_of(model.generate(ids, **kwargs))
    assert not any(layer.compressed for layer in ours.stats().layers)
    for expected, layer in zip(stock.layers, ours.layers, strict=True):
        torch.testing.assert_close(layer.keys, expected.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.values, expected.values, atol=1e-5, rtol=0)


def test_a_compressed_layers_keys_are_what_it_holds_and_never_read_while_decoding(monkeypatch):
    """Compressed, ``layer.keys`` lays each head's kept tokens out at their positions (the stock
    cache's keys there), zeros where a head holds nothing, padding included; building it is for
    readers outside kvpatch: generation never does."""
    import torch

    import kvpatch
    from kvpatch.cache import held_tensors
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model(key_scale=4.0)
    ids = random_prompt(200, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :15] = 0  # left padding
    mask[0, 50:53] = 0  # and a hole, as transformers' tests' random masks have
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    stock = kvpatch.compat.cache_of(model.generate(ids, attention_mask=mask, **kwargs))
    reads = []
    original = held_tensors.HeldTensors.keys

    def counted(layer):
        if layer.store is not None:
            reads.append(layer)
        return original.fget(layer)

    monkeypatch.setattr(held_tensors.HeldTensors, "keys", property(counted, original.fset))
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        ours = kvpatch.compat.cache_of(model.generate(ids, attention_mask=mask, **kwargs))
    assert reads == []
    layer, expected = ours.layers[1], stock.layers[1]
    assert layer.physical_lengths()[0].unique().numel() > 1  # heads of different lengths
    keys = layer.keys
    assert keys.shape == expected.keys.shape  # every position, as transformers lays them out
    stats = ours.stats().layers[1]
    for row in range(2):
        for head in range(keys.shape[1]):
            kept = stats.kept_positions(row, head)
            assert mask[row, kept[kept < 200]].all()  # padding is never held
            prompt = kept[kept < 200]  # the decoded tokens' keys depend on what was kept
            torch.testing.assert_close(keys[row, head, prompt], expected.keys[row, head, prompt])
            others = torch.ones(keys.shape[-2], dtype=torch.bool)
            others[kept] = False
            assert (keys[row, head, others] == 0).all()


@pytest.mark.parametrize("draft_policy", ["snapkv:0", "ada-snapkv:0.5", "think:0.5+snapkv:0.5"])
@pytest.mark.parametrize("length", [1, 9, 40, 300])
def test_assisted_decoding_with_an_enabled_draft_model(draft_policy, length):
    """transformers crops a draft model's cache one token into its prompt (the last accepted
    token is fed again): with the draft enabled too, even compressed, assisted greedy decoding
    gives the main model's own greedy tokens; the main model as its own assistant too."""
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model, draft = tiny_model(key_scale=4.0), tiny_model(seed=5, key_scale=4.0)
    for assistant in (model, draft):  # two candidates a round, as transformers' tests ask
        assistant.generation_config.num_assistant_tokens = 2
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
    ids = random_prompt(length, seed=3)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    kwargs.update(eos_token_id=model.config.vocab_size - 1)
    stock = model.generate(ids, **kwargs)
    with kvpatch.enabled(model, "snapkv:0"), kvpatch.enabled(draft, draft_policy):
        assert torch.equal(model.generate(ids, assistant_model=draft, **kwargs), stock)
        assert torch.equal(model.generate(ids, assistant_model=model, **kwargs), stock)


@pytest.mark.parametrize("policy", ["ada-snapkv:0.5", "think:0.5+snapkv:0.5", "snapkv:0"])
def test_a_crop_into_the_compressed_part_keeps_what_each_head_held_before_the_new_end(policy):
    import torch

    import kvpatch
    from kvpatch.tools.testing import random_prompt, tiny_model

    model = tiny_model(key_scale=4.0)
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, random_prompt(200))
        cache = context.copy_cache()
    before = cache.stats().layers[1]
    keys_before = cache.layers[1].keys.clone()
    cache.crop(-30)  # 30 of the prefill's tokens
    after = cache.stats().layers[1]
    assert cache.get_seq_length() == 170 and after.seen == 170
    for head in range(keys_before.shape[1]):
        kept = before.kept_positions(0, head)
        assert torch.equal(after.kept_positions(0, head), kept[kept < 170])
    torch.testing.assert_close(cache.layers[1].keys, keys_before[:, :, :170])


@pytest.mark.parametrize("policy", ["kvzip:0", "global-kvzip:0", "think:0+ada-kvzip-plus:0"])
def test_kvzip_at_ratio_0_reconstructs_nothing(policy, monkeypatch):
    """Nothing is removed at ratio 0, so KVzip's reconstruction is skipped: no tokenizer is
    needed, generate takes embeddings and beams, appended turns too, and every token and logit
    is the unpatched model's (transformers' generation tests have no tokenizer)."""
    import torch

    import kvpatch
    from kvpatch.feed import reconstruction
    from kvpatch.tools.testing import random_prompt, tiny_model

    def no_reconstruction(*args, **kwargs):
        raise AssertionError("reconstructed at ratio 0")

    monkeypatch.setattr(reconstruction, "reconstruct", no_reconstruction)
    model, ids = tiny_model(key_scale=4.0), random_prompt(60)
    embeds = model.get_input_embeddings()(ids)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True)
    kwargs.update(return_dict_in_generate=True)
    stock = [model.generate(ids, **kwargs), model.generate(inputs_embeds=embeds, **kwargs)]
    beams = model.generate(ids, num_beams=3, max_new_tokens=5, pad_token_id=0)
    with kvpatch.enabled(model, policy):
        ours = [model.generate(ids, **kwargs), model.generate(inputs_embeds=embeds, **kwargs)]
        assert torch.equal(
            model.generate(ids, num_beams=3, max_new_tokens=5, pad_token_id=0), beams
        )
        turn = kvpatch.prefill(model, ids).extend(random_prompt(10, seed=4))
        assert turn.cache.get_seq_length() == 70
    for a, b in zip(stock, ours, strict=True):
        assert torch.equal(a.sequences, b.sequences)
        torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores))


@pytest.mark.parametrize("policy", ["global-snapkv:0", "global-kvzip:0", "pyramid-snapkv:0.5"])
def test_a_crop_right_after_a_prefill_that_waits_for_every_layer(policy):
    """Shared budgets compress once every layer's prefill is known, at the next forward; a crop
    before it (transformers crops a draft model's cache right after its prefill) compresses them
    first: the next forward reads what was held before the new end (at ratio 0, the stock
    cache's logits)."""
    import torch
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import compat
    from kvpatch.tools.testing import random_prompt, tiny_model

    model, ids = tiny_model(key_scale=4.0), random_prompt(40)
    argument = compat.cache_argument(model)

    def prefill_crop_step(cache):
        model(ids, **{argument: cache})
        cache.crop(-1)
        return model(ids[:, 39:], **{argument: cache}).logits

    stock = prefill_crop_step(DynamicCache(config=model.config))
    with kvpatch.enabled(model, policy):
        cache = kvpatch.CompressedDynamicCache(config=model.config)
        ours = prefill_crop_step(cache)
    assert cache.get_seq_length() == 40 and not cache.deferred_layers
    if policy.endswith(":0"):
        torch.testing.assert_close(ours, stock)
    else:
        for layer in cache.stats().layers:
            held = layer.kept_positions(0, 0)
            assert held[-1] == 39 and (held[:-1] < 39).all()  # the crop, then the new token
