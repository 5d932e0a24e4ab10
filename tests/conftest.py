"""Tiny random decoder models built from configs (no network), and helpers shared by the tests."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, settings

from kvpatch.tools.testing import random_prompt, tiny_model

# property tests (tests/test_properties.py): a fixed set of examples by default, many more with
# --hypothesis-profile=long
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=60, derandomize=True, deadline=None, suppress_health_check=_SLOW_OK
)
settings.register_profile("long", max_examples=300, deadline=None, suppress_health_check=_SLOW_OK)
settings.load_profile("ci")


def make_model(name: str = "llama", attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny random fp32 model with GQA (4 query heads, 2 KV heads, head_dim 32), keys sharpened
    so that eviction choices matter."""
    return tiny_model(name, attn, seed=seed, key_scale=4.0)


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return random_prompt(length, batch, seed)


def unpatched_chat_reply(model, tokenizer, messages: list[dict], new_tokens: int) -> str:
    """The unpatched model's greedy reply to ``messages`` (the whole conversation at once, through
    the tokenizer's chat template: none of kvpatch's turn splitting)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="the complete suite: the slow tier too (real-model runs, where the demo model is "
        "cached, and the longest subprocess tests); what CI runs",
    )
    parser.addoption(
        "--device",
        default="cpu",
        help="torch's default device for the tests (models, prompts, random tensors), e.g. cuda",
    )


def pytest_configure(config):
    if config.getoption("--full"):
        config.option.markexpr = ""  # setup.cfg's addopts deselect the slow tier
    device = config.getoption("--device")
    try:
        torch.empty(0, device=device)
    except Exception as error:  # e.g. a torch built without CUDA asserts
        raise pytest.UsageError(f"--device {device}: {error}") from error
    torch.set_default_device(device)


def pytest_report_header(config):
    device = torch.get_default_device()
    return f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _kvzap_maps(request, tmp_path_factory, monkeypatch):
    """Tests that run every policy meet ``kvzap``, which needs a fitted map: each model the
    tests build gets a random one in a temporary folder (not the kvpatch cache), written
    through the real file format the first time the policy looks for it. Tests marked
    ``real_kvzap_paths`` see the default paths as they are (no map unless they write one)."""
    if request.node.get_closest_marker("real_kvzap_paths"):
        yield
        return
    from kvpatch.policies import HiddenStateMap, fitted_maps

    folder = tmp_path_factory.getbasetemp() / "kvzap-maps"
    real = fitted_maps.default_path

    def default_path_with_a_map(model):
        path = folder / real(model).name
        if not path.exists():
            config = model.config
            layers, kv = config.num_hidden_layers, config.num_key_value_heads
            g = torch.Generator(device="cpu").manual_seed(0)
            weight = torch.randn(layers, config.hidden_size, kv, generator=g, device="cpu")
            hidden_map = HiddenStateMap(
                "linear", weight, torch.zeros(layers, kv, device="cpu"), list(range(layers))
            )
            fitted_maps.save_map(path, hidden_map, model, {"random": True})
        return path

    monkeypatch.setattr(fitted_maps, "default_path", default_path_with_a_map)
    yield


@pytest.fixture
def attend_calls(monkeypatch):
    """How many layer steps :func:`kvpatch.attention.packed.attend` served."""
    from kvpatch.attention import packed

    calls = []
    real = packed.attend

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(packed, "attend", counting)
    return calls
