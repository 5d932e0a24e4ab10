"""Models spread over devices and processes: accelerate's offloading (weights moved in and out at
every forward) and tensor parallelism under torchrun on CPU (gloo), each rank compressing the KV
heads it holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvpatch
from kvpatch import compat
from kvpatch.tools.testing import random_prompt, save_tiny_checkpoint

WORKER = Path(__file__).parent / "tp_worker.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # a vocabulary that 2 ranks split evenly (transformers shards the LM head by columns)
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp"), vocab_size=260))


def greedy(model, ids, policy):
    with kvpatch.enabled(model, policy):
        cache = kvpatch.CompressedDynamicCache(config=model.config)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **{compat.cache_argument(model): cache},
        )
    return out.sequences[0, ids.shape[1] :], torch.stack(out.logits)[:, 0], cache


def test_offloaded_weights_generate_as_in_memory(checkpoint, tmp_path):
    """With accelerate's device map offloading layers to disk, the compressed generation is the
    in-memory one, and every layer's cache is on the device its layer runs on."""
    plain = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
    offloaded = AutoModelForCausalLM.from_pretrained(
        checkpoint, device_map=device_map, offload_folder=str(tmp_path)
    ).eval()
    assert set(offloaded.hf_device_map.values()) == {"cpu", "disk"}
    ids = random_prompt(300, vocab=250)
    tokens, logits, _ = greedy(plain, ids, "think:0.5+ada-snapkv:0.5")
    offloaded_tokens, offloaded_logits, cache = greedy(offloaded, ids, "think:0.5+ada-snapkv:0.5")
    assert torch.equal(tokens, offloaded_tokens)
    torch.testing.assert_close(logits, offloaded_logits, atol=1e-5, rtol=0)
    assert all(layer.keys.device.type == "cpu" for layer in cache.layers)


def run_ranks(checkpoint, policy, ids, out: Path, ranks=2) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}"]
    command += [str(WORKER), checkpoint, policy, json.dumps(ids[0].tolist()), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv:0.5", "think:0.5+knorm:0.5"])
def test_tensor_parallel_equals_one_process(checkpoint, policy, tmp_path):
    """Two ranks, one KV head each: a policy that decides each KV head alone gives the tokens and
    logits of one process, and each rank holds its own head's share of the cache."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = random_prompt(300, vocab=250)
    tokens, logits, cache = greedy(model, ids, policy)
    ranks = run_ranks(checkpoint, policy, ids, tmp_path)
    assert len(ranks) == 2
    for rank, result in enumerate(ranks):
        assert result["tokens"] == tokens.tolist()
        torch.testing.assert_close(torch.tensor(result["logits"]), logits, atol=1e-4, rtol=0)
        # rank r holds KV head r of every layer, with what one process keeps for that head
        assert result["held"] == [n[0, rank : rank + 1].tolist() for n in cache.physical_lengths()]


@pytest.mark.slow
def test_tensor_parallel_head_wise_budgets_are_per_rank(checkpoint, tmp_path):
    """``ada-`` shares each layer's budget among the KV heads a rank holds (as TOVA averages its
    scores over them): one head per rank keeps exactly the uniform budget."""
    ids = random_prompt(300, vocab=250)
    ranks = run_ranks(checkpoint, "ada-snapkv:0.5", ids, tmp_path)
    budget = 300 - 150 + 6  # the prefill's uniform share, then every decoded token but the last
    for result in ranks:
        assert all(held == [budget - 1] for held in result["held"])
