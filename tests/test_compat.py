"""kvpatch.compat on the installed transformers: each helper against the release's own behaviour.

The same tests run on every supported release (see tox.ini); where a helper follows a convention
that changed between releases, the convention of the installed release is checked against the
stock class, and every convention is checked by itself.
"""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import make_model, prompt
from oracle import greedy_logits
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import kvpatch
from kvpatch import CompressedDynamicCache, CompressedLayer, compat
from kvpatch.cache.lifecycle import Phase


def test_installed_release_is_in_the_supported_range():
    assert Version("4.56") <= compat.TRANSFORMERS_VERSION < Version("6")


# -- query_length ------------------------------------------------------------------------------


def test_query_length_of_an_int():
    assert compat.query_length(7) == 7


def test_query_length_of_a_cache_position_tensor():
    assert compat.query_length(torch.arange(10, 15)) == 5
    assert compat.query_length(torch.tensor([3])) == 1


def test_get_mask_sizes_counts_the_query_as_the_installed_release_passes_it():
    """The stock layer and CompressedLayer agree on what this release passes (a cache_position
    tensor up to 5.3, the query length from 5.4)."""
    keys = torch.randn(1, 2, 6, 4)
    stock, ours = DynamicLayer(), CompressedLayer()
    stock.update(keys, keys.clone())
    ours.update(keys, keys.clone())
    ours.lifecycle.move(Phase.DENSE)  # as after an uncompressed prefill
    parameter = list(inspect.signature(DynamicLayer.get_mask_sizes).parameters)[1]
    query = {"cache_position": torch.arange(6, 9), "query_length": 3}[parameter]
    assert ours.get_mask_sizes(query) == stock.get_mask_sizes(query) == (9, 0)


# -- tokens_to_remove (crop) -------------------------------------------------------------------


@pytest.mark.parametrize("argument", [-3, -6, 0, 2, 6, 10])
def test_tokens_to_remove_follows_the_stock_crop(argument):
    seen = 6
    keys = torch.randn(1, 2, seen, 4)
    layer = DynamicLayer()
    layer.update(keys, keys.clone())
    try:
        layer.crop(argument)
    except ValueError:
        with pytest.raises(ValueError, match="negative"):
            compat.tokens_to_remove(argument, seen)
        return
    assert compat.tokens_to_remove(argument, seen) == seen - layer.get_seq_length()


def _crop_convention(monkeypatch, zero_removes_nothing: bool, rejects_positive: bool) -> None:
    monkeypatch.setattr(compat, "_CROP_ZERO_REMOVES_NOTHING", zero_removes_nothing)
    monkeypatch.setattr(compat, "_CROP_REJECTS_POSITIVE", rejects_positive)


def test_tokens_to_remove_length_to_keep_convention(monkeypatch):
    """4.56-5.13: a non-negative argument is the length to keep."""
    _crop_convention(monkeypatch, zero_removes_nothing=False, rejects_positive=False)
    assert compat.tokens_to_remove(-3, 10) == 3
    assert compat.tokens_to_remove(-30, 10) == 10
    assert compat.tokens_to_remove(4, 10) == 6
    assert compat.tokens_to_remove(12, 10) == 0
    assert compat.tokens_to_remove(0, 10) == 10


def test_tokens_to_remove_zero_is_a_no_op_convention(monkeypatch):
    """5.14-5.19: crop(0) removes nothing; a positive length to keep still works."""
    _crop_convention(monkeypatch, zero_removes_nothing=True, rejects_positive=False)
    assert compat.tokens_to_remove(0, 10) == 0
    assert compat.tokens_to_remove(4, 10) == 6
    assert compat.tokens_to_remove(-3, 10) == 3


def test_tokens_to_remove_negative_only_convention(monkeypatch):
    """5.20+: only ``-n`` (remove n tokens) is accepted."""
    _crop_convention(monkeypatch, zero_removes_nothing=True, rejects_positive=True)
    assert compat.tokens_to_remove(-3, 10) == 3
    assert compat.tokens_to_remove(0, 10) == 0
    with pytest.raises(ValueError, match="negative number of tokens"):
        compat.tokens_to_remove(4, 10)


# -- layers ------------------------------------------------------------------------------------


def test_layer_is_initialized_on_a_stock_layer():
    layer = DynamicLayer()
    assert not compat.layer_is_initialized(layer)
    keys = torch.randn(1, 2, 3, 4)
    layer.update(keys, keys.clone())
    assert compat.layer_is_initialized(layer)
    compat.clear_layer(layer)
    assert not compat.layer_is_initialized(layer) and layer.keys is None


def test_compressed_cache_builds_the_stock_layers_for_sliding_layers():
    """CompressedDynamicCache(config=...) keeps whatever layer class this release builds for a
    sliding layer and replaces only the plain full-attention layers."""
    config = make_model("gemma3").config
    stock = DynamicCache(config=config)
    ours = CompressedDynamicCache(config=config)
    assert len(ours.layers) == len(stock.layers) == len(config.layer_types)
    for kind, stock_layer, layer in zip(config.layer_types, stock.layers, ours.layers, strict=True):
        if kind == "full_attention":
            assert type(stock_layer) is DynamicLayer and type(layer) is CompressedLayer
        else:
            assert type(layer) is type(stock_layer) and type(layer) is not DynamicLayer


def test_compressed_cache_without_config_replicates_compressed_layers():
    model = make_model("llama")
    cache = CompressedDynamicCache()
    with kvpatch.enabled(model, "snapkv:0.5"):
        greedy_logits(model, prompt(60), cache, 1)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(type(layer) is CompressedLayer for layer in cache.layers)


def test_reset_leaves_a_reusable_cache():
    """After reset the cache behaves as a new one (older releases zeroed tensors in place)."""
    model = make_model("llama")
    ids = prompt(80, seed=3)
    with kvpatch.enabled(model, "snapkv:0.5"):
        cache = CompressedDynamicCache(config=model.config)
        greedy_logits(model, prompt(120), cache, 2)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert not any(compat.layer_is_initialized(layer) for layer in cache.layers)
        reused, reused_tokens = greedy_logits(model, ids, cache, 3)
        fresh, fresh_tokens = greedy_logits(
            model, ids, CompressedDynamicCache(config=model.config), 3
        )
    assert torch.equal(reused_tokens, fresh_tokens)
    torch.testing.assert_close(reused, fresh, atol=0, rtol=0)


# -- attention functions -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flash_attention_2"])
def test_original_attention_for_each_backend(backend):
    model = make_model("llama", "sdpa")
    module = next(m for m in model.modules() if type(m).__name__ == "LlamaAttention")
    function = compat.original_attention(backend, module)
    if backend == "eager":
        assert function is sys.modules[type(module).__module__].eager_attention_forward
    elif backend == "sdpa":
        assert function is AttentionInterface._global_mapping[backend]
        assert function is ALL_ATTENTION_FUNCTIONS[backend]
    else:  # the stock flash function, shown a config that names the stock backend
        assert function.__wrapped__ is ALL_ATTENTION_FUNCTIONS[backend]
        assert compat.original_attention(backend, module) is function
    assert callable(function)


def test_original_attention_eager_uses_the_model_files_own_function():
    """Gemma 2's eager function soft-caps: the wrapped function must be Gemma 2's, not Llama's."""
    model = make_model("gemma2", "eager")
    module = next(m for m in model.modules() if type(m).__name__ == "Gemma2Attention")
    function = compat.original_attention("eager", module)
    assert function.__module__ == type(module).__module__


def test_stock_flash_attention_sees_the_stock_name(monkeypatch):
    """Stock flash attention picks its kernel by the implementation name (exactly, from 5.0): it
    must see ``flash_attention_2``, not ``kvpatch_flash_attention_2`` (a Hub kernel name)."""
    import transformers.modeling_flash_attention_utils as flash_utils

    seen = []

    class Loaded(Exception):
        pass

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        seen.append(implementation)
        raise Loaded

    monkeypatch.setattr(flash_utils, "lazy_import_flash_attention", lazy_import_flash_attention)
    model = make_model("llama")
    model.config._attn_implementation = "kvpatch_flash_attention_2"  # as kvpatch.enable leaves it
    module = next(m for m in model.modules() if type(m).__name__ == "LlamaAttention")
    query, key = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32)
    with pytest.raises(Loaded):
        compat.original_attention("flash_attention_2", module)(module, query, key, key, None)
    assert seen in ([None], ["flash_attention_2"])  # 4.56-4.57 pass no name


def test_enable_on_a_flash_model_only_changes_its_attention_modules():
    """transformers would check ``kvpatch_flash_attention_2`` as a flash kernel of its own (and,
    from 5.0, try to load it from the Hub): enable leaves the model's config alone, and only the
    attention modules call kvpatch's function."""
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # no flash-attn on CPU: set by hand
    modules = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    kvpatch.enable(model, "snapkv")
    try:
        assert compat.attention_implementation(model) == "flash_attention_2"
        assert model.model.config._attn_implementation == "flash_attention_2"
        assert all(m.config._attn_implementation == "kvpatch_flash_attention_2" for m in modules)
    finally:
        kvpatch.disable(model)
    assert all(m.config is model.config for m in modules)


def test_original_attention_eager_without_a_model_function():
    module = torch.nn.Linear(2, 2)  # torch.nn.modules.linear has no eager_attention_forward
    with pytest.raises(ValueError, match="eager_attention_forward"):
        compat.original_attention("eager", module)


def test_register_attention_registers_the_function_and_the_backends_mask():
    name = "kvpatch_test_compat_sdpa"

    def function(module, query, key, value, attention_mask, **kwargs):
        raise AssertionError("not called")

    assert not compat.is_registered(name)
    compat.register_attention(name, function, "sdpa")
    try:
        assert compat.is_registered(name)
        assert ALL_ATTENTION_FUNCTIONS[name] is function
        assert ALL_MASK_ATTENTION_FUNCTIONS[name] is AttentionMaskInterface._global_mapping["sdpa"]
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
    assert not compat.is_registered(name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_set_attention_implementation_round_trip(attn):
    model = make_model("llama", attn)
    assert compat.attention_implementation(model) == attn
    kvpatch.attention.register()
    compat.set_attention_implementation(model, f"kvpatch_{attn}")
    assert compat.attention_implementation(model) == f"kvpatch_{attn}"
    compat.set_attention_implementation(model, attn)
    assert compat.attention_implementation(model) == attn


# -- the cache argument and outputs ------------------------------------------------------------


def test_cache_argument_is_the_forward_parameter():
    model = make_model("llama")
    name = compat.cache_argument(model)
    assert name in compat.CACHE_ARGUMENTS
    assert name in inspect.signature(model.forward).parameters
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(prompt(12), use_cache=True, **{name: cache})
    assert cache.get_seq_length() == 12, f"the model ignored {name}="
    assert compat.cache_of(out) is cache


def test_cache_of_either_field_name():
    cache = object()
    assert compat.cache_of(SimpleNamespace(cache=cache)) is cache
    assert compat.cache_of(SimpleNamespace(past_key_values=cache)) is cache
    assert compat.cache_of(SimpleNamespace(cache=None, past_key_values=cache)) is cache
    assert compat.cache_of(SimpleNamespace(logits=None)) is None


def test_cache_of_a_generate_output():
    """GenerateDecoderOnlyOutput names its cache field like the forward's cache argument."""
    model = make_model("llama")
    out = model.generate(
        prompt(20), max_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    cache = compat.cache_of(out)
    assert cache is getattr(out, compat.cache_argument(model))
    assert cache.get_seq_length() == 20 + 2


@pytest.mark.parametrize(
    "model_type, rope_parameters, bases",
    [
        ("llama", {"rope_theta": 12345.0, "rope_type": "default"}, {"full": 12345.0}),
        (
            "gemma3_text",
            {
                "full_attention": {"rope_theta": 54321.0, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 777.0, "rope_type": "default"},
            },
            {"full": 54321.0, "sliding": 777.0},
        ),
    ],
)
def test_a_config_written_by_transformers_5_gives_its_rope_bases_on_every_line(
    tmp_path, model_type, rope_parameters, bases
):
    """RoPE's settings as transformers 5 writes them (``rope_parameters`` alone), read through
    :func:`compat.read_rope_parameters`: the rotary frequencies are those of the bases written,
    not a release's defaults (on 4.x they were silently 10,000 / 1,000,000)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128}
    fields |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    fields |= {"head_dim": 32, "vocab_size": 64, "rope_parameters": rope_parameters}
    if model_type == "gemma3_text":
        fields |= {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = AutoConfig.from_pretrained(tmp_path)
    compat.read_rope_parameters(config)
    model = AutoModelForCausalLM.from_config(config)
    found = set()  # each rotary table's second frequency, base ** (-2 / head_dim)
    for module in model.modules():
        for attribute in ("inv_freq", "full_attention_inv_freq", "sliding_attention_inv_freq"):
            value = getattr(module, attribute, None)
            if isinstance(value, torch.Tensor):
                found.add(round(float(value[1]), 6))
    assert found == {round(base ** (-2 / 32), 6) for base in bases.values()}


def test_a_tokenizer_naming_a_class_this_line_lacks_loads_as_a_fast_tokenizer(tmp_path):
    """transformers 5 names its tokenizers' class ``TokenizersBackend``, which 4.x does not know:
    such a class is read from ``tokenizer.json`` as a plain fast tokenizer, the same ids."""
    import json

    from kvpatch.tools.testing import byte_tokenizer

    saved = byte_tokenizer()
    saved.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "TokenizerOfAnotherLine"
    config_path.write_text(json.dumps(config))
    loaded = compat.load_tokenizer(tmp_path)
    text = "Lease of 12 May: the tenant is Ada."
    assert loaded(text).input_ids == saved(text).input_ids
    assert loaded.eos_token == saved.eos_token
