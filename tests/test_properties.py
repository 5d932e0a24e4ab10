"""Property tests: any policy the grammar accepts, any ratio, batch, left padding, GQA group,
prompt and decode length, against the masking oracle and the byte budget.

The default profile (``ci``, registered in conftest) runs a fixed, derandomized set of examples
in well under a minute; ``pytest -m properties --hypothesis-profile=long`` explores many more.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import generate, left_padded, run_oracle_generate
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers import DynamicCache

import kvpatch
from kvpatch import compat
from kvpatch.policies import reconstruction_of
from kvpatch.tools.eval import ByteCodec
from kvpatch.tools.testing import random_prompt, tiny_model

pytestmark = pytest.mark.properties

CHANNEL_POLICIES = ("think", "think-v")
TOKEN_POLICIES = [name for name in kvpatch.policy_names() if name not in CHANNEL_POLICIES]
QUERY_HEADS = 4
_models: dict[tuple[int, str], torch.nn.Module] = {}


def model_with(kv_heads: int, attn: str) -> torch.nn.Module:
    """A tiny Llama with ``QUERY_HEADS / kv_heads`` query heads per KV head (built once)."""
    key = (kv_heads, attn)
    if key not in _models:
        _models[key] = tiny_model(
            attn_implementation=attn,
            num_key_value_heads=kv_heads,
            num_attention_heads=QUERY_HEADS,
            head_dim=16,
            key_scale=4.0,
        )
    return _models[key]


ratios = st.sampled_from([0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.75, 0.9])


@st.composite
def policy_strings(draw) -> str:
    """Any composition the grammar accepts: a token policy, a key-channel term (think) and a
    value-channel term (think-v), each present or not (at least one), each with its own ratio."""
    parts = draw(
        st.sampled_from(
            [(1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 1), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
        )
    )
    terms = [
        f"think:{draw(ratios)}" if parts[1] else None,
        f"think-v:{draw(ratios)}" if parts[2] else None,
        f"{draw(st.sampled_from(TOKEN_POLICIES))}:{draw(ratios)}" if parts[0] else None,
    ]
    return "+".join(t for t in terms if t is not None)


@st.composite
def batches(draw, min_length: int = 8, max_length: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts ``[batch, width]`` and their mask: 1 to 4 rows of random lengths."""
    lengths = draw(st.lists(st.integers(min_length, max_length), min_size=1, max_size=4))
    seed = draw(st.integers(0, 2**16))
    prompts = [random_prompt(n, seed=seed + row)[0] for row, n in enumerate(lengths)]
    return left_padded(prompts)


def _enabled(model, policy: str):
    return kvpatch.enabled(model, policy, tokenizer=ByteCodec())


@given(
    policy=policy_strings(),
    batch=batches(),
    kv_heads=st.sampled_from([1, 2, 4]),
    attn=st.sampled_from(["sdpa", "eager"]),
    new_tokens=st.integers(1, 6),
)
def test_any_policy_matches_the_oracle(policy, batch, kv_heads, attn, new_tokens):
    ids, mask = batch
    model = model_with(kv_heads, attn)
    with _enabled(model, policy):
        tokens, logits, cache = generate(model, ids, mask, new_tokens, do_sample=False)
    split = reconstruction_of(kvpatch.parse_policy(policy))
    expected_tokens, expected_logits = oracle_generate(model, ids, mask, cache, new_tokens, split)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=2e-4, rtol=0)


def oracle_generate(model, ids, mask, cache, new_tokens: int, split: bool):
    """Greedy generation on the oracle with ``cache``'s evictions. ``split``: prefill all but the
    last prompt token first, as generate() does for a policy that reconstructs the context."""
    if not split:
        tokens, logits, _ = run_oracle_generate(
            model, ids, cache, mask=mask, new_tokens=new_tokens, do_sample=False
        )
        return tokens, logits
    from oracle import ORACLE, _evictions, evictions_of

    implementation = compat.attention_implementation(model)
    _evictions.update(evictions_of(cache))
    compat.set_attention_implementation(model, ORACLE)
    try:
        oracle_cache = DynamicCache(config=model.config)
        head = mask[:, :-1]
        with torch.no_grad():
            model(
                ids[:, :-1],
                attention_mask=head,
                position_ids=(head.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                **{compat.cache_argument(model): oracle_cache},
            )
        tokens, logits, _ = generate(
            model, ids, mask, new_tokens, cache=oracle_cache, do_sample=False
        )
    finally:
        compat.set_attention_implementation(model, implementation)
        _evictions.clear()
    return tokens, logits


def _split_reference(model, ids: torch.Tensor, new_tokens: int):
    """The unpatched model prefilling all but the last prompt token, then generating: the
    forwards a KVzip policy runs (it reconstructs the context before the last token)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], use_cache=True, **{compat.cache_argument(model): cache})
    return generate(model, ids, None, new_tokens, cache=cache, do_sample=False)


@given(
    policy=policy_strings(),
    length=st.integers(8, 120),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    kv_heads=st.sampled_from([1, 2, 4]),
    attn=st.sampled_from(["sdpa", "eager"]),
    new_tokens=st.integers(1, 6),
)
def test_ratio_zero_is_bit_exact(policy, length, rows, seed, kv_heads, attn, new_tokens):
    """Without padding, removing nothing gives bit for bit the unpatched model's logits."""
    zero = "+".join(f"{term.split(':')[0]}:0" for term in policy.split("+"))
    ids = random_prompt(length, rows, seed)
    model = model_with(kv_heads, attn)
    if reconstruction_of(kvpatch.parse_policy(zero)):
        reference_tokens, reference_logits, _ = _split_reference(model, ids, new_tokens)
    else:
        reference_tokens, reference_logits, _ = generate(model, ids, None, new_tokens)
    with _enabled(model, zero):
        tokens, logits, _ = generate(model, ids, None, new_tokens, do_sample=False)
    assert torch.equal(tokens, reference_tokens)
    assert torch.equal(logits, reference_logits)


@given(
    policy=policy_strings(),
    batch=batches(min_length=200, max_length=400),
    kv_heads=st.sampled_from([1, 2, 4]),
)
def test_bytes_are_the_policys_share_of_the_real_tokens(policy, batch, kv_heads):
    """After the prefill the cache holds ``1 - ratio`` of the bytes a full cache needs for the
    real (unpadded) tokens, up to the tokens a policy always keeps (its window or sinks): a
    token ratio ``r`` keeps ``1 - r`` of the tokens, a ThinK ratio ``c`` removes ``floor(c * d)``
    of the ``d`` key channels (half the bytes of a token are its keys), a ThinK-V ratio as many
    value channels."""
    ids, mask = batch
    terms = dict(term.split(":") for term in policy.split("+"))
    key_ratio, value_ratio = float(terms.pop("think", 0)), float(terms.pop("think-v", 0))
    token_ratio = float(next(iter(terms.values()), 0))
    config = model_with(kv_heads, "sdpa").config
    d = config.head_dim
    pruned = (math.floor(d * key_ratio) + math.floor(d * value_ratio)) / (2 * d)
    kept = (1 - token_ratio) * (1 - pruned)
    parsed = kvpatch.parse_policy(policy)
    always = max(parsed.protected_tokens, getattr(parsed, "window", 0))
    protected = always / int(mask.sum(-1).min())  # share of the tokens kept regardless
    assume(protected <= 0.5)
    model = model_with(kv_heads, "sdpa")
    with _enabled(model, policy):
        cache = kvpatch.prefill(model, ids, mask).cache
    per_token = 2 * config.num_key_value_heads * d * 4  # keys and values, fp32
    full = int(mask.sum()) * per_token * config.num_hidden_layers
    held = cache.stats().nbytes / full
    assert held >= kept - 0.02, f"{policy}: {held:.3f} of the full cache, {kept:.3f} expected"
    assert held <= kept + protected + 0.02, f"{policy}: {held:.3f} held, {kept:.3f} expected"


@given(
    policy=policy_strings(),
    batch=batches(min_length=4, max_length=150),
    kv_heads=st.sampled_from([1, 2, 4]),
    new_tokens=st.integers(1, 40),
)
def test_keys_and_values_never_outweigh_a_full_cache(policy, batch, kv_heads, new_tokens):
    """Whatever the prompt's length (shorter than a policy's window too) and however many
    tokens are decoded, the keys and values held (allocated capacity, spare room included) are
    at most a ``DynamicCache``'s of the same tokens, so the saving reported is never negative;
    what else is held is the index, a few bytes per held position."""
    ids, mask = batch
    model = model_with(kv_heads, "sdpa")
    with _enabled(model, policy):
        _, _, cache = generate(model, ids, mask, new_tokens, do_sample=False)
    stats = cache.stats()
    assert stats.kv_nbytes <= stats.full_nbytes
    assert stats.ratio >= 0 and f"({stats.ratio:.1%} saved)" in str(stats)
    positions = sum(int(layer.held.sum()) for layer in stats.layers if layer.held is not None)
    assert stats.index_nbytes <= 16 * positions + 4096 * len(stats.layers)
