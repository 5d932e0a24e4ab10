"""Decode over variable-length packed heads in one variable-length kernel call per layer
(:mod:`kvpatch.attention.varlen`), tested on the CPU through the reference kernel: the logits are
the oracle's, and the number of kernel calls and of other operations per layer step does not
grow with batch rows x KV heads."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, prompt
from oracle import evictions_of, greedy_logits, oracle_logits
from torch.utils._python_dispatch import TorchDispatchMode

import kvpatch
from kvpatch import CompressedDynamicCache
from kvpatch.attention import packed as packed_attention
from kvpatch.attention import varlen

#: the device the tests run on (``pytest --device``): the reference kernel stands in there
DEVICE = torch.get_default_device().type
#: variable-length heads whose kept key and value widths agree (what FlashAttention-2 takes)
ONE_CALL_POLICIES = [
    "ada-snapkv:0.6",
    "think:0.5+think-v:0.5+ada-knorm:0.5",
    "global-snapkv:0.75",
]


@pytest.fixture
def reference_kernel(monkeypatch):
    """The reference kernel serves fp32 on the CPU; its calls are counted."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3].numel() - 1)  # sequences in the call
        return varlen.reference_varlen(*args, **kwargs)

    monkeypatch.setitem(varlen.KERNELS, DEVICE, counted)
    monkeypatch.setitem(varlen.DTYPES, DEVICE, (torch.float32,))
    return calls


def test_the_reference_kernel_is_attention_per_sequence():
    """Against torch's sdpa run on each sequence alone, GQA included, and the log-sum-exp
    against the scores' own."""
    generator = torch.Generator().manual_seed(0)
    lengths_q, lengths_k = [1, 3, 2], [5, 0, 7]
    q = torch.randn(sum(lengths_q), 4, 16, generator=generator)
    k = torch.randn(sum(lengths_k), 2, 16, generator=generator)
    v = torch.randn(sum(lengths_k), 2, 16, generator=generator)
    cu_q = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    out, lse = varlen.reference_varlen(
        q, k, v, cu_q, cu_k, 3, 7, return_aux=varlen._Lse(), scale=0.3
    )
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    for sequence in range(len(lengths_q)):
        (q0, q1), (k0, k1) = q_bounds[sequence : sequence + 2], k_bounds[sequence : sequence + 2]
        if k1 == k0:
            assert (out[q0:q1] == 0).all() and torch.isneginf(lse[q0:q1]).all()
            continue
        queries = q[q0:q1].transpose(0, 1)[None]
        keys = k[k0:k1].transpose(0, 1).repeat_interleave(2, dim=0)[None]
        values = v[k0:k1].transpose(0, 1).repeat_interleave(2, dim=0)[None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, scale=0.3
        )
        torch.testing.assert_close(out[q0:q1], expected[0].transpose(0, 1), atol=1e-5, rtol=0)
        scores = (queries @ keys.transpose(-1, -2) * 0.3)[0]
        torch.testing.assert_close(lse[q0:q1], scores.logsumexp(-1).T, atol=1e-5, rtol=0)


def test_merging_by_log_sum_exp_is_one_softmax_over_both_parts():
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 9, generator=generator)
    values = torch.randn(2, 3, 9, 4, generator=generator)
    whole = scores.softmax(-1)[..., None, :] @ values
    parts = []
    for part in (slice(0, 5), slice(5, 9)):
        s = scores[..., part]
        parts.append(
            ((s.softmax(-1)[..., None, :] @ values[..., part, :])[..., 0, :], s.logsumexp(-1))
        )
    torch.testing.assert_close(varlen.merge(parts, torch.float32), whole[..., 0, :])


@pytest.mark.parametrize("policy", ONE_CALL_POLICIES)
def test_one_call_decoding_matches_the_oracle(policy, reference_kernel):
    model = make_model("llama")
    ids = prompt(300, batch=2)
    cache = CompressedDynamicCache(config=model.config)
    with kvpatch.enabled(model, policy):
        logits, tokens = greedy_logits(model, ids, cache, 6)
    packed = [layer for layer in cache.compressed_layers if not layer.store.packed.is_uniform]
    assert packed and len(reference_kernel) == 6 * len(packed)  # one call per layer and step
    expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_widths_flash_attention_cannot_take_keep_the_per_segment_path(reference_kernel):
    """ThinK on the keys alone leaves keys narrower than values: not one kernel's call."""
    model = make_model("llama")
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.6"):
        greedy_logits(model, prompt(200), CompressedDynamicCache(config=model.config), 3)
    assert reference_kernel == []


class _Operations(TorchDispatchMode):
    """Counts the operations dispatched, those inside the kernel apart (one launch each)."""

    def __init__(self):
        super().__init__()
        self.count, self.inside = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _operations_of_first_step(model, batch: int, counter: _Operations, monkeypatch):
    """The operations ``counter`` sees in the first layer step that packed attention serves,
    decoding a token for ``batch`` rows with ``ada-snapkv:0.6``; and the cache."""
    measured, real_attend = [], packed_attention.attend

    def attend(*args, **kwargs):
        if measured:  # one layer step is enough
            return real_attend(*args, **kwargs)
        with counter:
            output = real_attend(*args, **kwargs)
        measured.append(counter.count)
        return output

    monkeypatch.setattr(packed_attention, "attend", attend)
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        cache = CompressedDynamicCache(config=model.config)
        greedy_logits(model, prompt(200, batch=batch), cache, 1)
    monkeypatch.setattr(packed_attention, "attend", real_attend)
    return measured[0], cache


def _operations_of_one_step(batch: int, kv_heads: int, monkeypatch) -> tuple[int, int]:
    """(kernel calls, other operations) of one layer's packed attention at a decode step."""
    model = make_model("llama") if kv_heads == 2 else _model_with(kv_heads)
    counter, kernel_calls = _Operations(), []
    real_kernel = varlen.KERNELS[DEVICE]

    def kernel(*args, **kwargs):
        kernel_calls.append(1)
        counter.inside = True
        try:
            return real_kernel(*args, **kwargs)
        finally:
            counter.inside = False

    monkeypatch.setitem(varlen.KERNELS, DEVICE, kernel)
    operations, cache = _operations_of_first_step(model, batch, counter, monkeypatch)
    assert cache.compressed_layers[0].store.packed.lengths.shape == (batch, kv_heads)
    return len(kernel_calls) // len(cache.compressed_layers), operations


def _model_with(kv_heads: int):
    from kvpatch.tools.testing import tiny_model

    return tiny_model(
        "llama", key_scale=4.0, num_attention_heads=kv_heads * 2, num_key_value_heads=kv_heads
    )


def test_the_launches_per_layer_step_do_not_grow_with_rows_and_heads(reference_kernel, monkeypatch):
    one_row = _operations_of_one_step(1, 2, monkeypatch)
    many_rows = _operations_of_one_step(6, 2, monkeypatch)
    many_heads = _operations_of_one_step(3, 4, monkeypatch)
    assert one_row[0] == many_rows[0] == many_heads[0] == 1  # one kernel call per layer step
    assert one_row[1] == many_rows[1] == many_heads[1]  # and as many other operations


def test_a_kernel_that_fails_is_dropped_with_a_warning_and_the_segments_serve(monkeypatch):
    """FlashAttention-2 does not run on every GPU: the first failure warns, the step is served
    without it (the same logits), and the kernel is not tried again."""

    def failing(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    monkeypatch.setitem(varlen.KERNELS, DEVICE, failing)
    monkeypatch.setitem(varlen.DTYPES, DEVICE, (torch.float32,))
    model, ids = make_model("llama"), prompt(200)
    with kvpatch.enabled(model, "ada-snapkv:0.6"), pytest.warns(RuntimeWarning, match="Ampere"):
        logits, tokens = greedy_logits(model, ids, CompressedDynamicCache(config=model.config), 3)
    assert DEVICE not in varlen.KERNELS
    with kvpatch.enabled(model, "ada-snapkv:0.6"):
        again, _ = greedy_logits(model, ids, CompressedDynamicCache(config=model.config), 3, tokens)
    torch.testing.assert_close(logits, again, atol=0, rtol=0)


BATCHED_POLICIES = [
    "ada-snapkv:0.6",
    "think-v:0.5+ada-knorm:0.5",  # pruned value channels
    "think:0.5+ada-snapkv:0.6",  # keys narrower than values: no variable-length kernel
]


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("policy", BATCHED_POLICIES)
def test_without_the_kernel_a_padded_copy_serves_every_head_at_once(policy, quantize, monkeypatch):
    """Off the CPU (here: the CPU made to read as an accelerator does) with no variable-length
    kernel, the kept channels are laid out padded in one copy and read in one product: the
    oracle's logits (int8: the quantized cache's own reading on the CPU)."""
    model, ids = make_model("llama"), prompt(300, batch=2)
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config, quantize=quantize)
        expected, tokens = greedy_logits(model, ids, cache, 5)
    if quantize is None:
        expected = oracle_logits(model, ids, evictions_of(cache), tokens)
    as_on_an_accelerator(monkeypatch)
    with kvpatch.enabled(model, policy):
        cache = CompressedDynamicCache(config=model.config, quantize=quantize)
        logits, _ = greedy_logits(model, ids, cache, 5, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def as_on_an_accelerator(monkeypatch) -> None:
    """Read variable-length heads as off the CPU: no per-segment products, no slice copies."""
    from kvpatch.cache import packed

    monkeypatch.setattr(packed_attention, "SEGMENT_DEVICES", ())
    monkeypatch.setattr(packed, "SLICE_COPY_HEADS", 0)


def test_the_batched_reading_costs_as_many_operations_whatever_the_rows(monkeypatch):
    as_on_an_accelerator(monkeypatch)
    counts = [
        _operations_of_first_step(make_model("llama"), batch, _Operations(), monkeypatch)[0]
        for batch in (1, 6)
    ]
    assert counts[0] == counts[1]


@pytest.mark.parametrize("policy", ["ada-snapkv:0.6", "think:0.5+think-v:0.5+ada-knorm:0.5"])
def test_questions_sharing_a_context_read_it_in_one_call(policy, reference_kernel):
    """``generate_many``: every row's queries meet the shared context's packed heads in one
    call (each KV head a sequence); each answer is the question's alone, read per segment."""
    model = make_model("llama")
    generator = torch.Generator().manual_seed(11)
    asked = [torch.randint(3, 120, (n,), generator=generator) for n in (3, 9, 1, 14)]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, prompt(300))
        together = context.generate_many(asked, **options)
    kv_heads = model.config.num_key_value_heads
    assert reference_kernel and set(reference_kernel) == {kv_heads}  # sequences of each call
    varlen.KERNELS.pop(DEVICE)  # the questions alone, read without the kernel
    with kvpatch.enabled(model, policy):
        alone = [context.generate(q, **options) for q in asked]
    for one, batched in zip(alone, together, strict=True):
        assert torch.equal(one, batched)


@pytest.mark.skipif(
    not torch.cuda.is_available() or varlen.varlen_attn is None,
    reason="needs a CUDA GPU and torch >= 2.10 (torch's variable-length kernel)",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torchs_kernel_computes_what_the_reference_does(dtype):
    """The real FlashAttention-2 kernel, as :func:`varlen.packed_part` calls it (one query head,
    a sequence per (row, KV head), one of them empty), against the reference in fp32."""
    from kvpatch.cache.packed import PackedKV

    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([[40, 0], [7, 129]])
    total = int(lengths.sum())
    keys, values = (torch.randn(total, 128, generator=generator) for _ in range(2))
    packed = PackedKV(
        keys=keys.to("cuda", dtype),
        values=values.to("cuda", dtype),
        lengths=lengths.to("cuda"),
        channels=None,
        record=torch.zeros(0, device="cuda"),
        head_dim=128,
        value_dim=128,
    )
    grouped = (torch.randn(2, 2, 4, 128, generator=generator) * 128**-0.5).to("cuda", dtype)
    output, lse = varlen.packed_part(packed, grouped, varlen.varlen_attn)
    expected, expected_lse = varlen.packed_part(packed, grouped, varlen.reference_varlen)
    torch.testing.assert_close(output.float(), expected.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=2e-2, rtol=0)
