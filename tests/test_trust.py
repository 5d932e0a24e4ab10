"""Defects transformers' own tests found with kvpatch enabled at ratio 0, each reproduced here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_importing_inside_a_meta_device_context_leaves_generate_working():
    """``from_pretrained`` runs code under ``torch.device("meta")``; kvpatch imported there for
    the first time must build no tensor that later generation uses."""
    code = textwrap.dedent(
        """
        import torch
        with torch.device("meta"):
            import kvpatch
        from kvpatch.testing import random_prompt, tiny_model
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
    from kvpatch.testing import random_prompt, tiny_model

    model = tiny_model()
    model.generation_config.cache_implementation = "static"
    ids = random_prompt(20)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)


def _padded(kind: str):
    import torch

    from kvpatch.testing import random_prompt

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
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
        output_attentions=True, return_dict_in_generate=True,
    )  # fmt: skip


@pytest.mark.parametrize("padding", ["left", "right", "shared"])
def test_decode_attention_weights_are_laid_out_as_stock(padding):
    """``output_attentions`` gives weights over the logical positions: at ratio 0 those of the
    unpatched model; compressed, zero at every evicted position and summing to one."""
    import torch

    import kvpatch
    from kvpatch.testing import tiny_model

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
    from kvpatch.testing import random_prompt, tiny_model

    model = tiny_model(attn_implementation="eager", key_scale=4.0)
    ids = random_prompt(120)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    def logits(model):
        out = model.generate(
            ids, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
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
    from kvpatch.testing import tiny_model

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
    from kvpatch.testing import random_prompt, tiny_model

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
