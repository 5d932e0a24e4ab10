"""Defects transformers' own tests found with kvpatch enabled at ratio 0, each reproduced here."""

from __future__ import annotations

import subprocess
import sys
import textwrap


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
