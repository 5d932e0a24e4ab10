"""The harness that runs transformers' own tests with kvpatch (tests/external/): on a stand-in
checkout, the plugin enables kvpatch on every model that generates, and the runner reports the
tests that pass without kvpatch and fail with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).parent.parent
RUNNER = ROOT / "tests" / "external" / "run_transformers_tests.py"

MODEL_TESTS = """
import os
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


def test_greedy_generation_runs():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    ids = torch.randint(1, 64, (1, 12))
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 15)


def test_model_is_stock():
    import kvpatch

    assert not kvpatch.is_enabled(LlamaForCausalLM(LlamaConfig(**CONFIG)))


def test_base_model_is_left_alone():
    import kvpatch

    assert not kvpatch.is_enabled(LlamaModel(LlamaConfig(**CONFIG)))


def test_static_cache():
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    out = model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False,
                         cache_implementation="static")
    assert out.shape == (1, 6)


def test_static_cache_behind_a_helper():
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    try:  # as transformers' export tests call generate through a helper that wraps its error
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False,
                       cache_implementation="static")
    except Exception as error:
        raise RuntimeError("the helper failed: make sure the inputs suit generate()") from error


@unittest.skipUnless(os.environ.get("RUN_SLOW"), "a slow test: RUN_SLOW=1 runs it")
def test_slow():
    assert LlamaForCausalLM(LlamaConfig(**CONFIG)) is not None


def test_always_fails():
    raise AssertionError("fails with and without kvpatch: not a regression")
"""


def stand_in_checkout(root: Path) -> Path:
    init = root / "src" / "transformers" / "__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text(f'__version__ = "{transformers.__version__}"\n')
    tests = root / "tests" / "models" / "llama"
    tests.mkdir(parents=True)
    (tests / "test_modeling_llama.py").write_text(MODEL_TESTS)
    for package in (tests, tests.parent, tests.parent.parent):  # packages, as in transformers
        (package / "__init__.py").write_text("")
    return root


@pytest.mark.slow
def test_runner_reports_what_only_kvpatch_breaks(tmp_path):
    source = stand_in_checkout(tmp_path / "transformers")
    summary = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--source",
            str(source),
            "--models",
            "llama",
            "--policies",
            "snapkv:0",
            "--out",
            str(tmp_path / "out"),
            "--json",
            str(summary),
            "--slow",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 1, result.stdout + result.stderr  # one regression found
    (run,) = json.loads(summary.read_text())["runs"]
    # --slow: the slow test ran (and passed), so 6 of 7 pass without kvpatch
    assert (run["model"], run["policy"], run["tests"], run["passed"]) == ("llama", "snapkv:0", 7, 6)
    # the plugin enabled the causal LM (so the stock-only test fails) and nothing else
    assert run["regressions"] == ["tests.models.llama.test_modeling_llama::test_model_is_stock"]
    # a static cache is refused by design, with kvpatch's error: counted apart
    (kind,) = run["refusals"]
    assert "cache_implementation" in kind
    # also where the test's own error wraps kvpatch's (a chained cause)
    assert run["refusals"][kind] == [
        "tests.models.llama.test_modeling_llama::test_static_cache",
        "tests.models.llama.test_modeling_llama::test_static_cache_behind_a_helper",
    ]
    assert "documented refusals 2, regressions 1" in result.stdout


def test_runner_refuses_a_model_without_tests(tmp_path):
    source = stand_in_checkout(tmp_path / "transformers")
    result = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--source",
            str(source),
            "--models",
            "qwen2",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "test_modeling_qwen2.py" in result.stderr and "--models" in result.stderr


PADDING_FREE_TEST = """
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


class Tester:
    draws = 0

    def prepare_config_and_inputs_for_common(self):
        Tester.draws += 1
        torch.manual_seed(Tester.draws)  # the model's weights are drawn next: the run repeats
        ids = torch.randint(1, 64, (3, 9))
        mask = torch.ones(3, 9, dtype=torch.long)
        mask[1, :4] = mask[2, :2] = 0  # left padding, as transformers' testers draw it
        return LlamaConfig(**CONFIG), {"input_ids": ids, "attention_mask": mask}


class LlamaModelTest(unittest.TestCase):
    all_generative_model_classes = (LlamaForCausalLM,)

    def setUp(self):
        self.model_tester = Tester()

    def test_sdpa_padding_matches_padding_free_with_position_ids(self):
        pass
"""


def test_paired_draws_compare_stock_and_enabled_models_on_the_same_draws(tmp_path):
    """At ratio 0 kvpatch computes the padded and the packed forwards bit for bit as stock."""
    source = stand_in_checkout(tmp_path / "transformers")
    (source / "tests/models/llama/test_modeling_llama.py").write_text(PADDING_FREE_TEST)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/external/paired_draws.py"),
            "--source",
            str(source),
            "--model",
            "llama",
            "--policy",
            "ada-snapkv:0",
            "--draws",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.strip("| ").split(" | ") for line in result.stdout.splitlines()[3:]]
    assert sum(int(draws) for *_, draws in rows) == 3, result.stdout
    for stock, enabled, identical, _ in rows:  # a draw fails stock and enabled alike, or neither
        assert stock == enabled and identical == "True", result.stdout
