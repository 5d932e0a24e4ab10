"""Compressed contexts saved to a file and loaded back (kvpatch.saving): exact round trips, in
this process and another, files no larger than what the cache holds, and a clear error for every
file or model that does not match."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_model, prompt
from oracle import greedy_logits

import kvpatch
from kvpatch import saving
from kvpatch.tools.testing import tiny_model

ROUND_TRIPS = [
    ("llama", "snapkv:0.5", None),  # uniform heads, stored dense
    ("llama", "ada-snapkv:0.5", None),  # packed variable-length heads
    ("llama", "think:0.5+think-v:0.25+snapkv:0.5", None),  # pruned key and value channels
    ("llama", "ada-snapkv:0.5", "int4"),
    ("llama", "global-knorm:0.5", "int8"),
    ("gemma3", "ada-snapkv:0.5", None),  # sliding-window layers beside compressed ones
    ("llama", "snapkv:0", None),  # nothing evicted
]


def answer(context, question, steps: int = 6):
    """Greedy tokens (``generate``) and the logits of every step (one forward at a time), each
    from a copy of the context's cache."""
    tokens = context.generate(question, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    logits, _ = greedy_logits(context.model, question, context.copy_cache(), steps)
    return tokens, logits


@pytest.mark.parametrize("family, policy, quantize", ROUND_TRIPS)
def test_a_loaded_context_answers_as_the_saved_one(tmp_path, family, policy, quantize):
    model, question = make_model(family), prompt(7, seed=3)
    with kvpatch.enabled(model, policy):
        context = kvpatch.prefill(model, prompt(300), quantize=quantize)
        context.save(tmp_path / "context.kvz")
        loaded = kvpatch.load_context(model, tmp_path / "context.kvz")
        tokens, logits = answer(context, question)
        loaded_tokens, loaded_logits = answer(loaded, question)
        assert torch.equal(loaded_tokens, tokens)
        assert torch.equal(loaded_logits, logits)
        for held, saved in zip(
            loaded.cache.physical_lengths(), context.cache.physical_lengths(), strict=True
        ):
            assert (held is None and saved is None) or torch.equal(held, saved)
        assert loaded.cache.nbytes() <= context.cache.nbytes()  # no spare room beyond its own
        # later turns compress with the saved policy, as they would have before saving
        turn = prompt(40, seed=5)
        assert torch.equal(
            answer(loaded.extend(turn), question)[0], answer(context.extend(turn), question)[0]
        )


SAVE_IN_ANOTHER_PROCESS = """
import sys, torch, kvpatch
sys.path.insert(0, {tests!r})
from conftest import make_model, prompt
from oracle import greedy_logits
model = make_model("llama")
with kvpatch.enabled(model, "ada-snapkv:0.5"):
    kvpatch.prefill(model, prompt(300)).save({path!r})
"""


def test_a_context_saved_by_another_process_answers_identically(tmp_path):
    path = tmp_path / "context.kvz"
    script = SAVE_IN_ANOTHER_PROCESS.format(tests=str(Path(__file__).parent), path=str(path))
    subprocess.run([sys.executable, "-c", script], check=True)
    model, question = make_model("llama"), prompt(7, seed=3)
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        here = kvpatch.prefill(model, prompt(300))
        loaded = kvpatch.load_context(model, path)
        assert torch.equal(answer(loaded, question)[1], answer(here, question)[1])


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_file_holds_no_more_than_the_cache(tmp_path, quantize):
    """<= 1.02x the bytes held, at a size where the header and ids are small beside the KV."""
    model = tiny_model(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    with kvpatch.enabled(model, "ada-snapkv:0.5"):
        context = kvpatch.prefill(model, prompt(2000), quantize=quantize)
    context.save(tmp_path / "context.kvz")
    assert (tmp_path / "context.kvz").stat().st_size <= 1.02 * context.cache.nbytes()


@pytest.fixture
def saved(tmp_path):
    model = make_model("llama")
    with kvpatch.enabled(model, "snapkv:0.5"):
        kvpatch.prefill(model, prompt(200)).save(tmp_path / "context.kvz")
    return tmp_path / "context.kvz"


def load_into(model, path, policy="snapkv:0.5"):
    with kvpatch.enabled(model, policy):
        return kvpatch.load_context(model, path)


def test_another_model_is_named_in_the_error(saved):
    with pytest.raises(ValueError, match=r"config differs in .*num_hidden_layers"):
        load_into(tiny_model(num_hidden_layers=3), saved)
    with pytest.raises(ValueError, match="other weights"):
        load_into(tiny_model(seed=7, key_scale=4.0), saved)
    with pytest.raises(ValueError, match="saved from a float32 model; this one is bfloat16"):
        load_into(make_model("llama").to(torch.bfloat16), saved)
    with pytest.raises(ValueError, match=r"needs kvpatch\.enable"):
        kvpatch.load_context(make_model("llama"), saved)


def test_a_damaged_file_is_refused(saved, tmp_path):
    data = saved.read_bytes()
    truncated = tmp_path / "truncated.kvz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable kvpatch context"):
        load_into(make_model("llama"), truncated)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF  # a byte of the last tensor's data
    corrupted = tmp_path / "corrupted.kvz"
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="damaged"):
        load_into(make_model("llama"), corrupted)
    # a header that still parses, with one number changed
    from safetensors.torch import load_file, save_file

    header = saving.read_header(saved)
    header["layers"][0]["tail_start"] += 1
    edited = tmp_path / "edited.kvz"
    save_file(load_file(str(saved)), str(edited), metadata={"kvpatch": json.dumps(header)})
    with pytest.raises(ValueError, match="damaged"):
        load_into(make_model("llama"), edited)


def test_other_files_are_refused(saved, tmp_path):
    from safetensors.torch import save_file

    plain = tmp_path / "weights.safetensors"
    save_file({"x": torch.zeros(3)}, str(plain))
    with pytest.raises(ValueError, match="not a kvpatch context"):
        saving.read_header(plain)
    header = saving.read_header(saved)
    newer = tmp_path / "newer.kvz"
    save_file(
        {"x": torch.zeros(3)},
        str(newer),
        metadata={"kvpatch": json.dumps({**header, "format_version": 99})},
    )
    with pytest.raises(ValueError, match=r"format 99 .* this kvpatch reads format 1"):
        saving.read_header(newer)


@pytest.mark.parametrize("name", kvpatch.policy_names())
def test_every_policy_is_written_and_read_back(name):
    policy = kvpatch.parse_policy(f"{name}:0.5")
    data = json.loads(json.dumps(saving.encode_policy(policy)))
    assert saving.decode_policy(data) == policy


def test_flags_of_a_call_are_not_part_of_the_fingerprint(saved):
    model = make_model("llama")
    model.config.output_hidden_states, model.config.use_cache = True, False
    load_into(model, saved)  # the same computation: accepted
