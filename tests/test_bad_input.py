"""What each bad input gets: every row of the bad-input table (docs/bad-input.md) is a case here, and the
table and this list must agree. Then the inputs that cannot be refused but must not hurt: a long
generation's memory, many enable/disable cycles, two models in two threads."""

from __future__ import annotations

import gc
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import make_model, prompt
from transformers import (
    DynamicCache,
    StaticCache,
    StoppingCriteria,
    T5Config,
    T5ForConditionalGeneration,
)

import kvpatch
from kvpatch import CompressedDynamicCache, attention, compat
from kvpatch.tools.eval import EvalConfig
from kvpatch.tools.testing import tiny_model

TABLE = Path(__file__).resolve().parent.parent / "docs" / "bad-input.md"


@dataclass
class Case:
    entry: str  # the entry point, as the table names it
    given: str  # the bad input, likewise
    run: Callable[[], object]
    error: type[Exception] | None  # None: defined behaviour, checked by ``run`` itself
    says: str = ""  # a fragment of the error message that names the fix


def _model():
    return make_model()


def _enabled(policy="snapkv"):
    model = make_model()
    kvpatch.enable(model, policy)
    return model


def _context():
    return kvpatch.prefill(_enabled(), prompt(50))


def _disabled_context():
    context = _context()
    kvpatch.disable(context.model)
    return context


def _padded_batch():
    ids = prompt(40, batch=2)
    mask = torch.ones_like(ids)
    mask[1] = 0
    return ids, mask


def _t5():
    config = T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    return T5ForConditionalGeneration(config)


def _cache_from_another_model():
    context = _context()
    other = tiny_model(num_key_value_heads=4)
    kvpatch.enable(other, "snapkv")
    ids = torch.cat([context.input_ids, prompt(2)], dim=-1)
    other.generate(ids, max_new_tokens=2, **{compat.cache_argument(other): context.copy_cache()})


def _cache_from_a_model_with_other_layers(layers: int):
    def run():
        context = _context()
        other = tiny_model(num_hidden_layers=layers)
        kvpatch.enable(other, "snapkv")
        ids = torch.cat([context.input_ids, prompt(2)], dim=-1)
        cache = {compat.cache_argument(other): context.copy_cache()}
        other.generate(ids, max_new_tokens=2, **cache)

    return run


def _on_a_model_not_enabled():
    """The prefill cannot tell; the next forward refuses the uncompressed cache."""
    model = _model()
    argument = {compat.cache_argument(model): CompressedDynamicCache(policy="snapkv")}
    with torch.no_grad():
        model(prompt(5), use_cache=True, **argument)
        model(prompt(1), use_cache=True, **argument)


def _generate_with(cache_kwargs: Callable[[torch.nn.Module], dict], policy="snapkv"):
    def run():
        model = _enabled(policy) if policy else make_model()
        if not policy:
            kvpatch.enable(model)
        model.generate(prompt(20), max_new_tokens=2, pad_token_id=0, **cache_kwargs(model))

    return run


def _static_in_the_model_generation_config(model) -> dict:
    model.generation_config.cache_implementation = "static"
    return {}


def _static_in_a_generation_config(model) -> dict:
    from transformers import GenerationConfig

    return {"generation_config": GenerationConfig(cache_implementation="static")}


def _dynamic(model):
    return {compat.cache_argument(model): DynamicCache(config=model.config)}


def _filled_dynamic(model):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt(20), use_cache=True, **{compat.cache_argument(model): cache})
    return {compat.cache_argument(model): cache}


class _UsersCache(DynamicCache):
    """A cache class of the user's own."""


def _users_cache(model):
    return {compat.cache_argument(model): _UsersCache(config=model.config)}


def _static(model):
    return {compat.cache_argument(model): StaticCache(config=model.config, max_cache_len=64)}


def _stock_cache_without_policy():
    model = make_model()
    kvpatch.enable(model)  # no policy: stock caches stay stock
    cache = DynamicCache(config=model.config)
    model.generate(
        prompt(20), max_new_tokens=2, pad_token_id=0, **{compat.cache_argument(model): cache}
    )
    assert cache.get_seq_length() == 21


def _twice():
    model = _enabled("snapkv")
    kvpatch.enable(model, "tova")


def _short_prompt_kept_whole():
    model = _enabled("snapkv:0.5")  # window 64: a 20-token prompt is all window
    cache = kvpatch.prefill(model, prompt(20)).cache
    assert all(int(n.min()) == 20 for n in cache.physical_lengths())


def _one_token_prompt():
    model = _enabled("snapkv:0.5")
    context = kvpatch.prefill(model, prompt(1))
    assert context.generate(prompt(3), max_new_tokens=2, do_sample=False).shape == (1, 2)


def _half_precision(dtype):
    def run():
        model = make_model().to(dtype)
        ids = prompt(120)
        dense = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, use_cache=True, **{compat.cache_argument(model): dense})
        with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.5"):
            context = kvpatch.prefill(model, ids)
            # 60 tokens of 120 and the 4 sinks, keys at half width
            assert context.cache.nbytes() < 0.5 * 64 / 60 * kvpatch.cache_nbytes(dense)
            assert all(layer.keys.dtype == dtype for layer in context.cache.layers)
            new = context.generate(prompt(4, seed=2), max_new_tokens=3, do_sample=False)
        assert new.shape == (1, 3)

    return run


_checkpoint = []


def _tiny_checkpoint() -> str:
    """A tiny model with a chat tokenizer saved once per test session."""
    if not _checkpoint:
        import tempfile

        from kvpatch.tools.testing import save_tiny_checkpoint

        _checkpoint.append(save_tiny_checkpoint(tempfile.mkdtemp(prefix="kvpatch-bad-input-")))
    return _checkpoint[0]


def _ask_with_the_default_policy():
    """Compresses with kvpatch.DEFAULT_POLICY, the commands' default, and leaves the model as it
    was."""
    answer = _ask(context="a text " * 40, question="why?", max_new_tokens=2)()
    assert answer["kv_bytes"] < 0.6 * answer["uncompressed_kv_bytes"]


def _ask(**call):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    path = _tiny_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path)
    ask = pipeline(
        "kvpatch-text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(path)
    )
    return lambda: ask(**call)


def _chat(policy="knorm:0.5"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _tiny_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path)
    return kvpatch.ChatSession(model, AutoTokenizer.from_pretrained(path), policy)


def _cli(*argv):
    from kvpatch.tools import cli

    def run():
        assert cli.main(list(argv)) == 2

    return run


def _is_enabled_on_anything():
    assert kvpatch.is_enabled("a string") is False


def _uppercase_policy():
    assert kvpatch.parse_policy("SNAPKV:0.5") == kvpatch.SnapKV(ratio=0.5)


CASES = [
    Case(
        "enable", "not a model (a string)", lambda: kvpatch.enable("model"), ValueError, "causal LM"
    ),
    Case(
        "enable",
        "a non-transformers module",
        lambda: kvpatch.enable(torch.nn.Linear(2, 2)),
        ValueError,
        "causal LM",
    ),
    Case(
        "enable", "an encoder-decoder model", lambda: kvpatch.enable(_t5()), ValueError, "decoder"
    ),
    Case(
        "enable",
        "a model whose layers all use a sliding window",
        lambda: kvpatch.enable(tiny_model("mistral-sliding"), "snapkv"),
        ValueError,
        "sliding window",
    ),
    Case(
        "enable",
        "a policy of the wrong type",
        lambda: kvpatch.enable(_model(), 3),
        ValueError,
        "string or a Policy",
    ),
    Case("enable", "enabled twice", _twice, ValueError, "disable(model) first"),
    Case(
        "disable",
        "a model never enabled",
        lambda: kvpatch.disable(_model()),
        ValueError,
        "not enabled",
    ),
    Case(
        "enabled",
        "not a model",
        lambda: kvpatch.enabled("x", "snapkv").__enter__(),
        ValueError,
        "causal LM",
    ),
    Case("is_enabled", "not a model", _is_enabled_on_anything, None),
    Case("policy string", "empty", lambda: kvpatch.parse_policy(""), ValueError, "NAME[:RATIO]"),
    Case(
        "policy string",
        "an empty term",
        lambda: kvpatch.parse_policy("think+"),
        ValueError,
        "empty term",
    ),
    Case(
        "policy string",
        "an unknown name",
        lambda: kvpatch.parse_policy("snapvk"),
        ValueError,
        "Did you mean 'snapkv'",
    ),
    Case(
        "policy string",
        "a ratio that is not a number",
        lambda: kvpatch.parse_policy("snapkv:half"),
        ValueError,
        "in [0, 1)",
    ),
    Case(
        "policy string",
        "a NaN ratio",
        lambda: kvpatch.parse_policy("snapkv:nan"),
        ValueError,
        "in [0, 1)",
    ),
    Case(
        "policy string",
        "a negative ratio",
        lambda: kvpatch.parse_policy("snapkv:-0.1"),
        ValueError,
        "in [0, 1)",
    ),
    Case(
        "policy string",
        "ratio 1.0 (everything removed)",
        lambda: kvpatch.parse_policy("snapkv:1.0"),
        ValueError,
        "in [0, 1)",
    ),
    Case(
        "policy string",
        "four terms",
        lambda: kvpatch.parse_policy("think+think-v+snapkv+tova"),
        ValueError,
        "at most three",
    ),
    Case(
        "policy string",
        "two token policies",
        lambda: kvpatch.parse_policy("think+snapkv+tova"),
        ValueError,
        "one token policy",
    ),
    Case(
        "policy string",
        "two value-channel policies",
        lambda: kvpatch.parse_policy("think-v+think-v:0.25"),
        ValueError,
        "one value-channel policy",
    ),
    Case(
        "policy string",
        "a prefix on a channel policy",
        lambda: kvpatch.parse_policy("ada-think"),
        ValueError,
        "unknown policy",
    ),
    Case("policy string", "upper case", _uppercase_policy, None),
    Case(
        "policy object",
        "a NaN ratio",
        lambda: kvpatch.SnapKV(ratio=float("nan")),
        ValueError,
        "in [0, 1)",
    ),
    Case(
        "policy object",
        "a ratio given as a string",
        lambda: kvpatch.SnapKV(ratio="0.5"),
        ValueError,
        "a number",
    ),
    Case(
        "policy object",
        "a negative prompt window",
        lambda: kvpatch.KVzap(prompt_window=-1),
        ValueError,
        "integer prompt_window >= 0",
    ),
    Case(
        "policy object",
        "a channel policy without a window",
        lambda: kvpatch.ThinKValues(window=0),
        ValueError,
        "integer window >= 1",
    ),
    Case(
        "policy object",
        "a wrapper around a channel policy",
        lambda: kvpatch.AdaKV(kvpatch.ThinK()),
        ValueError,
        "token scorer",
    ),
    Case(
        "policy object",
        "two token policies added",
        lambda: kvpatch.SnapKV() + kvpatch.TOVA(),
        ValueError,
        "one token policy",
    ),
    Case(
        "policy object",
        "a value selector as key channels",
        lambda: kvpatch.policies.Composed(channels=kvpatch.ThinKValues(), tokens=kvpatch.SnapKV()),
        ValueError,
        "does not prune keys",
    ),
    Case(
        "CompressedDynamicCache",
        "a config that is not a config",
        lambda: CompressedDynamicCache(config=3),
        TypeError,
        "model.config",
    ),
    Case(
        "CompressedDynamicCache",
        "prefill_chunk_size not a positive integer",
        lambda: CompressedDynamicCache(prefill_chunk_size=2.5),
        ValueError,
        "positive integer",
    ),
    Case(
        "CompressedDynamicCache",
        "quantize not int8 or int4",
        lambda: CompressedDynamicCache(quantize="int3"),
        ValueError,
        "'int8', 'int4'",
    ),
    Case(
        "Quantization",
        "a key group of 0 tokens",
        lambda: kvpatch.Quantization(8, key_group=0),
        ValueError,
        "key_group must be a positive integer",
    ),
    Case(
        "CompressedDynamicCache",
        "decode_budget not a positive integer",
        lambda: CompressedDynamicCache(policy="snapkv", decode_budget=0),
        ValueError,
        "positive integer",
    ),
    Case(
        "CompressedDynamicCache",
        "decode_budget below the policy's window",
        lambda: CompressedDynamicCache(policy="snapkv", decode_budget=10),
        ValueError,
        "larger budget",
    ),
    Case(
        "CompressedDynamicCache",
        "decode_budget with kvzip",
        lambda: CompressedDynamicCache(policy="kvzip", decode_budget=128),
        ValueError,
        "drop decode_budget",
    ),
    Case(
        "CompressedDynamicCache",
        "a cache filled by another model",
        _cache_from_another_model,
        ValueError,
        "make a new CompressedDynamicCache",
    ),
    Case(
        "CompressedDynamicCache",
        "a cache filled by a model with fewer layers",
        _cache_from_a_model_with_other_layers(3),
        ValueError,
        "make a new CompressedDynamicCache",
    ),
    Case(
        "CompressedDynamicCache",
        "a cache filled by a model with more layers",
        _cache_from_a_model_with_other_layers(1),
        ValueError,
        "make a new CompressedDynamicCache",
    ),
    Case(
        "CompressedDynamicCache",
        "on a model not enabled",
        _on_a_model_not_enabled,
        RuntimeError,
        "kvpatch.enable(model)",
    ),
    Case(
        "prefill",
        "a model not enabled",
        lambda: kvpatch.prefill(_model(), prompt(5)),
        ValueError,
        "kvpatch.enable",
    ),
    Case(
        "prefill",
        "token ids as a list",
        lambda: kvpatch.prefill(_enabled(), [1, 2, 3]),
        TypeError,
        "torch.Tensor",
    ),
    Case(
        "prefill",
        "float token ids",
        lambda: kvpatch.prefill(_enabled(), prompt(5).float()),
        ValueError,
        "integer token ids",
    ),
    Case(
        "prefill",
        "3-D token ids",
        lambda: kvpatch.prefill(_enabled(), prompt(5)[None]),
        ValueError,
        "[batch, tokens]",
    ),
    Case(
        "prefill",
        "no tokens",
        lambda: kvpatch.prefill(_enabled(), prompt(5)[:, :0]),
        ValueError,
        "at least one token",
    ),
    Case(
        "prefill",
        "a mask of another shape",
        lambda: kvpatch.prefill(_enabled(), prompt(5), torch.ones(1, 4)),
        ValueError,
        "must match",
    ),
    Case(
        "prefill",
        "a row that is all padding",
        lambda: kvpatch.prefill(_enabled(), *_padded_batch()),
        ValueError,
        "all padding",
    ),
    Case(
        "prefill",
        "chunk_size not a positive integer",
        lambda: kvpatch.prefill(_enabled(), prompt(50), chunk_size=0),
        ValueError,
        "positive integer",
    ),
    Case(
        "prefill",
        "chunk_size with kvzip",
        lambda: kvpatch.prefill(_enabled("kvzip"), prompt(50), chunk_size=16),
        ValueError,
        "drop chunk_size",
    ),
    Case("prefill", "a prompt shorter than the policy's window", _short_prompt_kept_whole, None),
    Case("prefill", "a one-token prompt", _one_token_prompt, None),
    Case(
        "generate",
        "a row that is all padding",
        lambda: _enabled().generate(
            *_padded_batch()[:1], attention_mask=_padded_batch()[1], max_new_tokens=2
        ),
        ValueError,
        "all padding",
    ),
    Case(
        "generate",
        "a DynamicCache",
        _generate_with(_dynamic),
        ValueError,
        "kvpatch.disable(model) first",
    ),
    Case(
        "generate",
        "a StaticCache",
        _generate_with(_static),
        ValueError,
        "CompressedDynamicCache(config=model.config)",
    ),
    Case(
        "generate",
        "a DynamicCache already filled",
        _generate_with(_filled_dynamic),
        ValueError,
        "given a DynamicCache",
    ),
    Case(
        "generate",
        "a Cache class of the user's own",
        _generate_with(_users_cache),
        ValueError,
        "given a _UsersCache",
    ),
    Case(
        "generate",
        "cache_implementation='static'",
        _generate_with(lambda m: {"cache_implementation": "static"}),
        ValueError,
        "would hold the whole cache",
    ),
    Case(
        "generate",
        "cache_implementation='quantized' (a QuantizedCache)",
        _generate_with(lambda m: {"cache_implementation": "quantized"}),
        ValueError,
        "would hold the whole cache",
    ),
    Case(
        "generate",
        "cache_implementation on model.generation_config",
        _generate_with(_static_in_the_model_generation_config),
        ValueError,
        "would hold the whole cache",
    ),
    Case(
        "generate",
        "cache_implementation in a generation_config argument",
        _generate_with(_static_in_a_generation_config),
        ValueError,
        "would hold the whole cache",
    ),
    Case("generate", "a DynamicCache, enabled without a policy", _stock_cache_without_policy, None),
    Case("generate", "bf16 weights", _half_precision(torch.bfloat16), None),
    Case("generate", "fp16 weights", _half_precision(torch.float16), None),
    Case(
        "CompressedContext.generate",
        "another batch size",
        lambda: _context().generate(prompt(3, batch=2)),
        ValueError,
        "batch size",
    ),
    Case(
        "CompressedContext.generate",
        "an empty question",
        lambda: _context().generate(prompt(3)[:, :0]),
        ValueError,
        "at least one token",
    ),
    Case(
        "CompressedContext.generate",
        "its model disabled since",
        lambda: _disabled_context().generate(prompt(3)),
        ValueError,
        "no longer enabled",
    ),
    Case(
        "CompressedContext.generate_many",
        "its model disabled since",
        lambda: _disabled_context().generate_many([prompt(3)[0]]),
        ValueError,
        "no longer enabled",
    ),
    Case(
        "CompressedContext.extend",
        "its model disabled since",
        lambda: _disabled_context().extend(prompt(3)),
        ValueError,
        "no longer enabled",
    ),
    Case(
        "CompressedContext.extend",
        "token ids as a list",
        lambda: _context().extend([1, 2]),
        TypeError,
        "torch.Tensor",
    ),
    Case(
        "pipeline",
        "no question",
        lambda: _ask(context="a text")(),
        ValueError,
        "question= or questions=",
    ),
    Case(
        "pipeline",
        "an empty context",
        lambda: _ask(context="", question="why?", policy="snapkv")(),
        ValueError,
        "non-empty text",
    ),
    Case("pipeline", "no policy, on a model not enabled", _ask_with_the_default_policy, None),
    Case(
        "ChatSession",
        "no policy, on a model not enabled",
        lambda: _chat(None),
        ValueError,
        "needs a policy",
    ),
    Case("ChatSession", "an empty turn", lambda: _chat().ask("  "), ValueError, "needs some text"),
    Case("kvpatch command", "no prompt (exit status 2)", _cli("generate"), None),
    Case(
        "eval CLI",
        "an unknown policy",
        lambda: EvalConfig(policies=["snapvk"]),
        ValueError,
        "Did you mean",
    ),
    Case("eval CLI", "no samples", lambda: EvalConfig(samples=0), ValueError, ">= 1"),
    Case(
        "eval CLI",
        "a context too short for a haystack",
        lambda: EvalConfig(context_tokens=5),
        ValueError,
        ">= 64",
    ),
    Case("eval CLI", "an unknown task", lambda: EvalConfig(tasks=["poems"]), ValueError, "tasks:"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.entry}: {c.given}")
def test_bad_input(case: Case):
    if case.error is None:
        case.run()
        return
    with pytest.raises(case.error, match=re.escape(case.says)):
        case.run()


def test_the_table_lists_every_case():
    rows = re.findall(r"^\| `?([^|`]+?)`? \| ([^|]+?) \| ([^|]+?) \|$", TABLE.read_text(), re.M)
    in_table = {(entry, given) for entry, given, _ in rows if entry != "entry point"}
    assert in_table == {(c.entry, c.given) for c in CASES}


class _Stamp(StoppingCriteria):
    """Records the cache's bytes after every decoding step."""

    def __init__(self, cache):
        self.cache, self.bytes = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        self.bytes.append(self.cache.nbytes())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.slow
def test_ten_thousand_decode_steps_hold_constant_memory():
    """With a decode budget, the bytes held (spare capacity and bookkeeping included) stop
    growing once the budget is reached."""
    model = tiny_model(num_hidden_layers=1, key_scale=4.0, max_position_embeddings=16384)
    steps = 10_000
    with kvpatch.enabled(model, "think:0.5+ada-snapkv:0.5"):
        cache = CompressedDynamicCache(config=model.config, decode_budget=96, decode_interval=16)
        stamp = _Stamp(cache)
        model.generate(
            prompt(64),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=[stamp],
            **{compat.cache_argument(model): cache},
        )
    assert cache.get_seq_length() == 64 + steps - 1  # the last token is not fed back
    assert max(stamp.bytes[steps // 2 :]) <= max(stamp.bytes[500 : steps // 2])


def test_a_thousand_enable_disable_cycles_leak_nothing():
    model = make_model()
    kvpatch.enable(model, "snapkv")
    kvpatch.disable(model)
    gc.collect()
    objects, bindings = len(gc.get_objects()), len(attention.modules._policies)
    generate = type(model).generate
    for _ in range(1000):
        kvpatch.enable(model, "think+ada-snapkv")
        kvpatch.disable(model)
    gc.collect()
    assert len(gc.get_objects()) <= objects + 10  # a few interpreter caches, not 1000 of anything
    assert len(attention.modules._policies) == bindings
    assert compat.attention_implementation(model) == "sdpa"
    assert "generate" not in vars(model) and type(model).generate is generate


def test_two_models_in_two_threads_match_running_one_after_the_other():
    models = {"snapkv:0.6": make_model(seed=1), "think:0.5+ada-tova:0.5": make_model(seed=2)}
    ids = {policy: prompt(200, seed=i) for i, policy in enumerate(models)}

    def run(policy):
        model = models[policy]
        return model.generate(ids[policy], max_new_tokens=12, do_sample=False, pad_token_id=0)

    for policy, model in models.items():
        kvpatch.enable(model, policy)
    try:
        alone = {policy: run(policy) for policy in models}
        together: dict[str, torch.Tensor] = {}
        threads = [
            threading.Thread(target=lambda p=p: together.__setitem__(p, run(p))) for p in models
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for model in models.values():
            kvpatch.disable(model)
    for policy in models:
        assert torch.equal(together[policy], alone[policy])
