"""KVzap: a fitted map from hidden states to scores, its files, and the cache ranking tokens by it
in a prefill, in chunks, in appended turns and under a decode budget.

References are computed here: the hidden states each attention module reads are recorded by
hooks of the test's own, scored with the map by plain matrix products, and the tokens a cache
must hold follow from a top-k over those scores.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import evictions_of, greedy_logits, oracle_logits

import kvpatch
from kvpatch.policies import HiddenStateMap, KVzap, KVzip, KVzipPlus, fitted_maps
from kvpatch.tools import fitting
from kvpatch.tools.testing import tiny_model

SINKS = 4


def random_map(model, seed: int = 0, kind: str = "linear") -> HiddenStateMap:
    config = model.config
    layers, hidden, kv = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
    g = torch.Generator().manual_seed(seed)
    if kind == "linear":
        return HiddenStateMap(
            "linear",
            torch.randn(layers, hidden, kv, generator=g),
            torch.randn(layers, kv),
            list(range(layers)),
        )
    return HiddenStateMap(
        "mlp",
        torch.randn(layers, hidden, 8, generator=g),
        torch.randn(layers, 8, generator=g),
        list(range(layers)),
        torch.randn(layers, 8, kv, generator=g),
        torch.zeros(layers, kv),
    )


def kvzap(model, ratio=0.5, seed=0, kind="linear", **fields) -> KVzap:
    policy = KVzap(ratio=ratio, **fields)
    policy.use_map(random_map(model, seed, kind))
    return policy


class HiddenRecorder:
    """Every hidden state each attention module reads, in order: ``[batch, tokens, hidden]``
    per forward."""

    def __init__(self, model):
        self.seen: dict[int, list[torch.Tensor]] = {}
        modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
        self.hooks = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in modules]

    def _hook(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.seen.setdefault(module.layer_idx, []).append(hidden.detach().clone())

    def scores(self, hidden_map: HiddenStateMap, layer: int) -> torch.Tensor:
        """``[batch, kv_heads, tokens]``: the map's scores of every token seen, by hand."""
        hidden = torch.cat(self.seen[layer], dim=1).float()
        row = hidden_map.layers.index(layer)
        out = hidden @ hidden_map.weight[row] + hidden_map.bias[row]
        if hidden_map.kind == "mlp":
            out = torch.nn.functional.gelu(out) @ hidden_map.weight2[row] + hidden_map.bias2[row]
        return out.transpose(1, 2)

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def top_with_sinks(scores, valid, count, sinks=SINKS):
    """The ``count`` best of ``scores`` ``[kv_heads, tokens]`` among ``valid`` tokens, the first
    ``sinks`` valid ones always."""
    ranked = scores.clone().masked_fill(~valid, -math.inf)
    leading = valid & (valid.long().cumsum(-1) <= sinks)
    ranked = ranked.masked_fill(leading, math.inf)
    keep = torch.zeros_like(valid)
    keep.scatter_(-1, ranked.argsort(-1, descending=True)[..., :count], True)
    return keep & valid


@pytest.fixture
def model():
    return tiny_model(key_scale=4.0)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_prefill_keeps_the_best_map_scores_and_reads_like_the_oracle(model, kind):
    """Left-padded rows: each head keeps the sinks and the best of its real tokens by the map's
    score; decoding on the packed cache gives the masking oracle's logits."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (2, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    policy = kvzap(model, 0.5, kind=kind)
    kvpatch.enable(model)
    recorder = HiddenRecorder(model)
    try:
        cache = kvpatch.CompressedDynamicCache(config=model.config, policy=policy)
        name = kvpatch.compat.cache_argument(model)
        with torch.no_grad():
            model(ids, attention_mask=mask, use_cache=True, **{name: cache})
    finally:
        recorder.remove()
    evictions = evictions_of(cache)
    for layer in range(model.config.num_hidden_layers):
        scores = recorder.scores(policy.map, layer)
        for row in range(2):
            valid = mask[row].bool().expand(scores.shape[1], -1)
            count = int(valid[0].sum()) - math.floor(int(valid[0].sum()) * 0.5)
            expected = top_with_sinks(scores[row], valid, count)
            assert torch.equal(evictions[layer].keep[row], expected), (layer, row)
    # a single row, so that the oracle's positions match the compressed run's
    cache = kvpatch.CompressedDynamicCache(config=model.config, policy=policy)
    logits, tokens = greedy_logits(model, ids[:1], cache, steps=4)
    kvpatch.disable(model)
    reference = oracle_logits(model, ids[:1], evictions_of(cache), tokens)
    torch.testing.assert_close(logits, reference.float(), atol=2e-4, rtol=1e-4)


def test_chunked_prefill_ranks_what_is_held_by_the_scores_kept(model):
    """After each chunk, every head holds the budget's best tokens of what it held and the
    chunk, by the scores each token got when it arrived."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, model.config.vocab_size, (1, 70), generator=g)
    policy = kvzap(model, 0.5)
    kvpatch.enable(model)
    recorder = HiddenRecorder(model)
    try:
        context = kvpatch.prefill(model, ids, policy=policy, chunk_size=16)
    finally:
        recorder.remove()
        kvpatch.disable(model)
    for layer in range(model.config.num_hidden_layers):
        scores = recorder.scores(policy.map, layer)[0]  # [kv_heads, 70]
        heads = scores.shape[0]
        held = torch.zeros(heads, 70, dtype=torch.bool)
        held[:, :16] = top_with_sinks(
            scores[:, :16], torch.ones(heads, 16, dtype=torch.bool), 8
        )  # the first chunk, a plain prefill
        for start in range(16, 70, 16):
            end = min(start + 16, 70)
            candidates = held.clone()
            candidates[:, start:end] = True
            held = top_with_sinks(scores, candidates, end - math.floor(end * 0.5))
        got = context.cache.layers[layer].store.kept_mask()[0]
        assert torch.equal(got, held), layer


def test_extend_keeps_the_best_of_each_turn(model):
    """An appended turn keeps ``1 - ratio`` of its own tokens, the best by the map (no sinks:
    the turn does not begin the sequence); what was held before stays."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=g)
    turn = torch.randint(5, model.config.vocab_size, (1, 20), generator=g)
    policy = kvzap(model, 0.5)
    kvpatch.enable(model)
    recorder = HiddenRecorder(model)
    try:
        context = kvpatch.prefill(model, ids, policy=policy)
        before = [layer.store.kept_mask()[0].clone() for layer in context.cache.layers]
        extended = context.extend(turn[0])
    finally:
        recorder.remove()
        kvpatch.disable(model)
    for layer, kept in enumerate(before):
        scores = recorder.scores(policy.map, layer)[0]
        turn_scores = scores[:, 40:]
        every = torch.ones_like(turn_scores, dtype=torch.bool)
        expected = top_with_sinks(turn_scores, every, 10, sinks=0)
        got = extended.cache.layers[layer].store.kept_mask()[0]
        assert torch.equal(got[:, :40], kept)
        assert torch.equal(got[:, 40:], expected), layer


def test_decode_budget_ranks_by_the_scores_of_decoded_tokens(model):
    """Under a decode budget, each compression keeps the budget's best of what is held, every
    decoded token scored from its own hidden state; the cache stays bounded."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, model.config.vocab_size, (1, 24), generator=g)
    budget, interval, steps = 16, 4, 30
    policy = kvzap(model, 0.5)
    kvpatch.enable(model)
    recorder = HiddenRecorder(model)
    try:
        cache = kvpatch.CompressedDynamicCache(
            config=model.config, policy=policy, decode_budget=budget, decode_interval=interval
        )
        greedy_logits(model, ids, cache, steps=steps)
    finally:
        recorder.remove()
        kvpatch.disable(model)
    total = 24 + steps
    for layer in range(model.config.num_hidden_layers):
        scores = recorder.scores(policy.map, layer)[0][:, :total]
        heads = scores.shape[0]
        every = torch.ones(heads, 24, dtype=torch.bool)
        held = torch.zeros(heads, total, dtype=torch.bool)
        held[:, :24] = top_with_sinks(scores[:, :24], every, 12)
        for position in range(24, total):
            if held.sum(-1).float().mean() >= budget + interval:
                held = top_with_sinks(scores, held, budget)
            held[:, position] = True
        got = cache.layers[layer].store.kept_mask()[0]
        assert torch.equal(got, held), layer
        assert int(got.sum(-1).max()) < budget + interval + 1


@pytest.mark.parametrize(
    "spec", ["ada-kvzap:0.5", "global-kvzap:0.5", "span-kvzap:0.5", "think:0.5+kvzap:0.5"]
)
def test_kvzap_composes_with_budgets_spans_and_channels(model, spec):
    """Every prefix and composition runs end to end with a map set on its scorer, holding the
    ratio's bytes (+-2%)."""
    policy = kvpatch.parse_policy(spec)
    policy.hidden_state_scorer.use_map(random_map(model))
    ids = torch.randint(5, model.config.vocab_size, (1, 400), generator=torch.Generator())
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, ids)
        answer = context.generate(ids[0, :5], max_new_tokens=3, do_sample=False)
    assert answer.shape[-1] >= 1
    kept = sum(int(layer.store.physical_lengths().sum()) for layer in context.cache.layers)
    real = 400 * model.config.num_key_value_heads * model.config.num_hidden_layers
    if spec.startswith("think"):  # the channel window (full width, always kept) costs a little
        assert all(layer.store.packed.channels is not None for layer in context.cache.layers)
        assert 0.5 < context.cache.stats().ratio < policy.ratio
    else:
        assert kept == pytest.approx(real * 0.5, rel=0.02)
        assert context.cache.stats().ratio == pytest.approx(0.5, abs=0.02)


def test_quantized_storage_and_saved_contexts_keep_the_scores(model, tmp_path):
    """A kvzap context stored as int8 is saved and loaded with its scores: a turn appended
    after loading keeps what it keeps before saving."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, model.config.vocab_size, (1, 40), generator=g)
    turn = torch.randint(5, model.config.vocab_size, (20,), generator=g)
    map_path = tmp_path / "map.safetensors"
    fitted_maps.save_map(map_path, random_map(model), model, {"test": True})
    policy = KVzap(ratio=0.5, path=str(map_path))
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, ids, quantize="int8")
        context.save(tmp_path / "ctx.kvz")
        loaded = kvpatch.load_context(model, tmp_path / "ctx.kvz")
        a, b = context.extend(turn), loaded.extend(turn)
    for x, y in zip(a.cache.layers, b.cache.layers, strict=True):
        assert torch.equal(x.store.kept_mask(), y.store.kept_mask())
        assert torch.equal(x.token_scores, y.token_scores)


def test_map_files_round_trip_and_refuse_what_is_not_theirs(model, tmp_path):
    path = tmp_path / "map.safetensors"
    original = random_map(model, kind="mlp")
    fitted_maps.save_map(path, original, model, {"mean_r2": 0.5})
    loaded = fitted_maps.load_map(path, model)
    for name, tensor in original.tensors().items():
        assert torch.equal(loaded.tensors()[name], tensor)
    # the same weights in bfloat16 are the same model
    fitted_maps.load_map(path, tiny_model(key_scale=4.0).to(torch.bfloat16))
    with pytest.raises(ValueError, match="other weights"):
        fitted_maps.load_map(path, tiny_model(seed=7, key_scale=4.0))
    with pytest.raises(ValueError, match=r"config differs in .*num_hidden_layers"):
        fitted_maps.load_map(path, tiny_model(num_hidden_layers=3))
    data = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable kvzap map"):
        fitted_maps.load_map(tmp_path / "short.safetensors", model)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="damaged"):
        fitted_maps.load_map(tmp_path / "flipped.safetensors", model)
    with pytest.raises(ValueError, match="kvpatch fit-scorer"):
        fitted_maps.load_map(tmp_path / "none.safetensors", model)


@pytest.mark.real_kvzap_paths
def test_a_kvzap_policy_without_a_fitted_map_names_the_command(model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPATCH_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="fit-scorer"):
        kvpatch.enable(model, "kvzap:0.5")
    assert not kvpatch.is_enabled(model)


@pytest.mark.real_kvzap_paths
def test_the_default_path_is_where_kvzap_looks(model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPATCH_CACHE", str(tmp_path))
    fitted_maps.save_map(fitted_maps.default_path(model), random_map(model), model, {})
    ids = torch.randint(5, model.config.vocab_size, (1, 30), generator=torch.Generator())
    with kvpatch.enabled(model, "kvzap:0.5"):
        context = kvpatch.prefill(model, ids)
    assert context.cache.stats().ratio > 0.4


def test_ridge_fitting_recovers_a_planted_linear_relation(model, monkeypatch):
    """Targets that are an exact linear function of the hidden states are fitted back to that
    function (held-out R² 1), through the whole fitting loop."""
    config = model.config
    g = torch.Generator().manual_seed(6)
    planted_w = torch.randn(config.hidden_size, config.num_key_value_heads, generator=g)
    planted_b = torch.randn(config.num_key_value_heads, generator=g)
    real = fitting.features_and_targets

    def planted(model_, tokenizer, document, scorer=None):
        layers, xs, _ = real(model_, tokenizer, document, scorer)
        return layers, xs, [x.double() @ planted_w.double() + planted_b.double() for x in xs]

    monkeypatch.setattr(fitting, "features_and_targets", planted)
    texts = [f"document {i}" for i in range(5)]
    hidden_map, report = fitting.fit_map(model, SpreadTokenizer(), texts, held_out=1)
    assert report["mean_r2"] > 0.9999
    for row in range(len(hidden_map.layers)):
        torch.testing.assert_close(hidden_map.weight[row], planted_w, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(hidden_map.bias[row], planted_b, atol=2e-3, rtol=1e-3)


def test_a_map_learns_the_scores_of_the_target_it_names(model, monkeypatch):
    """``target`` picks the scorer whose reconstruction scores the fit reads (KVzip+ by default,
    KVzip on request), and the report names it; a target that scores no reconstruction is
    refused, naming the valid ones."""
    real = fitting.features_and_targets
    seen = []

    def recording(model_, tokenizer, document, scorer=None):
        seen.append(scorer)
        return real(model_, tokenizer, document, scorer)

    monkeypatch.setattr(fitting, "features_and_targets", recording)
    texts = [f"document {i}" for i in range(3)]
    targets = {}
    for target, kind in (("kvzip-plus", KVzipPlus), ("kvzip", KVzip)):
        seen.clear()
        _, report = fitting.fit_map(model, SpreadTokenizer(), texts, target=target)
        assert report["target"] == target
        assert len(seen) == 3 and all(type(s) is kind for s in seen)
        with kvpatch.enabled(model):
            targets[target] = real(model, SpreadTokenizer(), texts[0], seen[0])[2]
    # KVzip+ weighs KVzip's attention by what each value adds: other targets, not a relabelling
    assert not torch.allclose(targets["kvzip"][0], targets["kvzip-plus"][0])
    for bad in ("snapkv", "global-kvzip"):
        with pytest.raises(ValueError, match="reconstructs the context: 'kvzip-plus' or 'kvzip'"):
            fitting.fit_map(model, SpreadTokenizer(), texts, target=bad)
    with pytest.raises(ValueError, match="must drop tokens"):
        fitting.fit_map(model, SpreadTokenizer(), texts, target="kvzip:0")


class SpreadTokenizer:
    """Not a real tokenizer: 120 ids seeded by the text, spread over the tiny model's vocabulary
    so that the hidden states span their space (a fit needs that; byte ids do not)."""

    chat_template = None
    pad_token_id = 0

    def __call__(self, text, return_tensors=None, add_special_tokens=False, **_):
        seed = sum(text.encode()) * 31 + len(text)
        ids = torch.randint(5, 250, (120,), generator=torch.Generator().manual_seed(seed)).tolist()
        if return_tensors == "pt":
            return _Ids(torch.tensor([ids]))
        return {"input_ids": ids}


class _Ids(dict):
    def __init__(self, ids):
        super().__init__(input_ids=ids)
        self.input_ids = ids
