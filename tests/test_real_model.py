"""The real demo model answers a 1k-token needle, with the full cache and with snapkv:0.5.

Marked ``slow`` (deselected by default; run with ``python -m pytest -m slow``) and skipped unless
the demo model is cached (``python -m kvpatch.demo`` fetches and converts it).
"""

from __future__ import annotations

import random

import pytest

import kvpatch
from kvpatch import demo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_model():
    if not demo.is_cached():
        pytest.skip(f"the demo model is not cached in {demo.cache_dir()}: python -m kvpatch.demo")
    return demo.load(download=False)


@pytest.mark.parametrize(
    "policy",
    [
        None,
        "span-snapkv:0.5",
        pytest.param(
            "snapkv:0.5",
            marks=pytest.mark.xfail(
                reason="SnapKV keeps the number's first digits only: the later ones are attended "
                "only while decoding (README, 'Multi-token answers'); span-snapkv keeps them",
                strict=False,
            ),
        ),
    ],
)
def test_needle_in_1k_tokens(real_model, policy):
    from kvpatch.eval.harness import answer
    from kvpatch.eval.tasks import HFCodec, make_sample

    model, tokenizer = real_model
    codec = HFCodec(tokenizer)
    # seed 0 puts the needle mid-context, which this model retrieves with the full cache
    sample = make_sample("single", codec, 1000, random.Random(0))
    if policy is None:
        result = answer(model, sample, None, "prefill", 12)
    else:
        with kvpatch.enabled(model):
            result = answer(model, sample, policy, "prefill", 12)
    text = codec.decode(result["tokens"])
    assert sample.answers[0] in text, (policy, sample.answers, text)
