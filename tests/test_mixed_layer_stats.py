"""stats() on a model that mixes sliding-window and full-attention layers (Gemma 3): how the
saving splits between the two kinds, at the real model's head shape (1 KV head of 256)."""

from __future__ import annotations

import re

import pytest
from transformers import DynamicCache

import kvpatch
from kvpatch.cache.stats import CacheStats, layer_stats
from kvpatch.tools import cli
from kvpatch.tools.testing import random_prompt, save_tiny_checkpoint, tiny_model

#: Gemma 3's pattern (five sliding layers, then one full), cut short
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
WINDOW = 32
#: Gemma 3 270M's attention shape: 4 query heads sharing 1 KV head of 256 channels
GEMMA_SHAPE = dict(
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    sliding_window=WINDOW,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    hidden_size=64,
)


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3", key_scale=4.0, **GEMMA_SHAPE)


def compressed_stats(model, policy: str, tokens: int = 200):
    with kvpatch.enabled(model):
        return kvpatch.prefill(model, random_prompt(tokens), policy=policy).cache.stats()


def test_the_saving_splits_by_layer_kind(gemma):
    stats = compressed_stats(gemma, "snapkv:0.75")
    full, sliding = stats.full_attention, stats.sliding_window
    assert [layer.sliding for layer in stats.layers] == [t != "full_attention" for t in LAYER_TYPES]
    assert len(full.layers) == 2 and len(sliding.layers) == 4
    assert full.nbytes + sliding.nbytes == stats.nbytes
    assert full.full_nbytes + sliding.full_nbytes == stats.full_nbytes
    # a sliding layer holds its window, uncompressed: nothing saved there
    per_token = 2 * 256 * 4  # keys and values of the one KV head, fp32
    for layer in sliding.layers:
        assert layer.nbytes == layer.full_nbytes <= WINDOW * per_token
        assert not layer.compressed and layer.kept is None
    # the full-attention layers hold a quarter of 200 tokens, or the policy's window of 64
    assert all(layer.compressed for layer in full.layers)
    assert full.full_nbytes == 2 * 200 * per_token
    assert 0.6 < full.ratio < 0.7 and sliding.ratio == 0.0
    assert stats.ratio == pytest.approx(1 - stats.kv_nbytes / stats.full_nbytes)


def test_the_summary_line_says_so(gemma):
    text = str(compressed_stats(gemma, "knorm:0.5"))
    total = float(re.search(r"\(([\d.]+)% saved\)", text).group(1))
    split = re.search(
        r"; full-attention layers ([\d.]+) of ([\d.]+) MiB \(([\d.]+)% saved\), "
        r"sliding-window layers ([\d.]+) MiB \(their windows\)$",
        text,
    )
    assert split is not None, text
    assert 45 < float(split.group(3)) < 55 and total < float(split.group(3))
    plain = str(compressed_stats(tiny_model(), "knorm:0.5"))  # no sliding layer: no split
    assert "full-attention layers" not in plain and plain.endswith("% saved)")


def test_a_compressed_cache_holds_less_than_a_stock_one(gemma):
    """Right after the prefill a stock cache's sliding layers still hold views of the whole
    prompt; kvpatch's hold their windows, and its full-attention layers are compressed."""
    ids = random_prompt(200)
    stock = DynamicCache(config=gemma.config)
    gemma(ids, use_cache=True, **{kvpatch.compat.cache_argument(gemma): stock})
    stock_stats = CacheStats([layer_stats(layer) for layer in stock.layers])
    assert (
        stock_stats.sliding_window.nbytes
        > compressed_stats(gemma, "snapkv:0").sliding_window.nbytes
    )
    assert kvpatch.cache_nbytes(stock) > compressed_stats(gemma, "snapkv:0.75").nbytes


def test_the_generate_command_reports_the_split(tmp_path, capsys):
    checkpoint = save_tiny_checkpoint(tmp_path / "gemma", "gemma3", **GEMMA_SHAPE)
    argv = ["generate", "some words " * 30, "--model", str(checkpoint), "--policy", "knorm:0.5"]
    assert cli.main([*argv, "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "; full-attention layers" in err and "sliding-window layers" in err
