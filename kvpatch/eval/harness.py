"""Run policies x ratios on generated retrieval tasks and report accuracy, memory and speed."""

from __future__ import annotations

import copy
import csv
import dataclasses
import itertools
import json
import math
import random
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpatch
from kvpatch import compat, replay
from kvpatch.cache import CompressedDynamicCache, CompressedLayer, cache_nbytes
from kvpatch.eval.tasks import TASKS, ByteCodec, Codec, HFCodec, Sample, make_samples
from kvpatch.policies import LayerInputs, Plan, Policy
from kvpatch.testing import tiny_model

DEFAULT_POLICIES = ("snapkv", "ada-snapkv", "tova", "knorm", "streamingllm", "think:0.5+snapkv")
DEFAULT_RATIOS = (0.25, 0.5, 0.75, 0.9)
#: ``prefill``: the question is in the prefill; ``agnostic``: the context is compressed first
MODES = ("prefill", "agnostic")
FULL = "full"


@dataclass
class EvalConfig:
    """What to run. ``policies`` are policy strings; a term without ``:RATIO`` gets each ratio of
    ``ratios`` (``think:0.5+snapkv`` sweeps the SnapKV ratio, ThinK stays at 0.5)."""

    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    tasks: list[str] = field(default_factory=lambda: ["single"])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    context_tokens: int = 2000
    samples: int = 20
    seed: int = 0
    model: str = "demo"
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    digits: int = 6
    output: str = "kvpatch-eval"
    plot: bool = True
    progress: bool = True
    #: one exact prefill per sample, every policy's cache compressed from its recorded queries,
    #: keys and values (much faster; the same decisions); False: one prefill per run
    shared_prefill: bool = True

    def __post_init__(self) -> None:
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
        for policy in self.policies:
            for ratio in self.ratios:
                kvpatch.parse_policy(with_ratio(policy, ratio))  # fail early on a typo


def with_ratio(policy: str, ratio: float) -> str:
    """``policy`` with ``ratio`` given to every term that has none."""
    terms = [t.strip() for t in policy.split("+")]
    return "+".join(t if ":" in t else f"{t}:{ratio:g}" for t in terms)


# -- models --------------------------------------------------------------------------------------


def load_model(name: str, attn_implementation: str = "sdpa", dtype: str = "float32"):
    """``(model, codec)`` for ``demo`` (the embedded SmolLM2), ``tiny`` (random), or a local
    checkpoint directory."""
    torch_dtype = getattr(torch, dtype)
    if name == "tiny":
        model = tiny_model(
            attn_implementation=attn_implementation,
            dtype=torch_dtype,
            head_dim=16,
            max_position_embeddings=8192,
        )
        return model, ByteCodec()
    if name == "demo":
        from kvpatch import demo

        model, tokenizer = demo.load(dtype=torch_dtype, attn_implementation=attn_implementation)
        return model, HFCodec(tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=torch_dtype, attn_implementation=attn_implementation
    ).eval()
    return model, HFCodec(tokenizer)


# -- one run -------------------------------------------------------------------------------------


def needle_survival(cache, spans: list[list[int]]) -> list[float] | None:
    """For each token of the first expected value, the fraction of (layer, KV head) pairs that
    hold it; None for an uncompressed cache."""
    layers = [
        layer
        for layer in getattr(cache, "layers", [])
        if isinstance(layer, CompressedLayer) and layer.is_compressed
    ]
    if not layers or not spans:
        return None
    span = torch.tensor(spans[0])
    held = torch.zeros(len(span))
    pairs = 0
    for layer in layers:
        for head in range(layer.physical_lengths().shape[1]):
            kept = layer.kept_positions(0, head).cpu()
            held += torch.isin(span, kept).float()
            pairs += 1
    return (held / pairs).tolist()


def new_tokens_for(sample: Sample, digits: int) -> int:
    """Enough tokens for every value (digits may be one token each) and some punctuation."""
    return (digits + 4) * len(sample.answers) + 4


class _AnswerComplete:
    """Stops generation once the text holds as many ``digits``-digit numbers as expected."""

    def __init__(self, codec: Codec, start: int, numbers: int, digits: int):
        self.codec, self.start, self.numbers = codec, start, numbers
        self.pattern = re.compile(rf"\d{{{digits},}}")

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        text = self.codec.decode(input_ids[0, self.start :].tolist())
        done = len(self.pattern.findall(text)) >= self.numbers and not text[-1:].isdigit()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _finish(model, ids, split, cache, logits, max_new_tokens, stop) -> list[int]:
    """Ask the question (if not in the cache yet) and decode greedily; returns the new tokens."""
    argument = compat.cache_argument(model)
    if split < ids.shape[1]:  # the question, on the (compressed) context
        logits = model(ids[:, split:], use_cache=True, logits_to_keep=1, **{argument: cache}).logits
    first = logits[:, -1].argmax(-1, keepdim=True)
    tokens = first
    eos = _eos_ids(model)
    if max_new_tokens > 1 and int(first) not in eos:
        from transformers import StoppingCriteriaList

        prompt = torch.cat([ids, first], dim=-1)
        criteria = StoppingCriteriaList([stop]) if stop is not None else None
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens - 1,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=model.generation_config.pad_token_id or 0,
            stopping_criteria=criteria,
            **{argument: cache},
        )
        tokens = generated[:, ids.shape[1] :]
    return [t for t in tokens[0].tolist() if t not in eos]


@torch.no_grad()
def answer(
    model,
    sample: Sample,
    policy: str | None,
    mode: str,
    max_new_tokens: int,
    stop=None,
    tokenizer=None,
    context_cache=None,
) -> dict:
    """Answer one sample with its own prefill; ``policy`` None is the full cache on the unpatched
    model. In ``agnostic`` mode the context goes through :func:`kvpatch.prefill` first, or is
    ``context_cache``, a context already compressed (a copy of it is used)."""
    argument = compat.cache_argument(model)
    ids = sample.input_ids[None].to(model.device)
    split = sample.context_ids.shape[0] if mode == "agnostic" else ids.shape[1]
    logits = None
    start = time.perf_counter()
    if context_cache is not None:
        cache = copy.deepcopy(context_cache)
    elif policy is None:
        cache = DynamicCache(config=model.config)
        out = model(ids[:, :split], use_cache=True, logits_to_keep=1, **{argument: cache})
        logits = out.logits
    elif mode == "agnostic":
        cache = kvpatch.prefill(model, ids[:, :split], policy=policy, tokenizer=tokenizer).cache
    else:
        cache = CompressedDynamicCache(config=model.config, policy=policy)
        logits = kvpatch.patching.prefill_into(model, cache, ids, torch.ones_like(ids), tokenizer)
    prefill_s = time.perf_counter() - start
    return _answer_from(model, sample, ids, split, cache, logits, prefill_s, max_new_tokens, stop)


def _answer_from(model, sample, ids, split, cache, logits, prefill_s, max_new_tokens, stop):
    kv_bytes = cache_nbytes(cache)
    survival = needle_survival(cache, sample.needle_spans)
    start = time.perf_counter()
    tokens = _finish(model, ids, split, cache, logits, max_new_tokens, stop)
    return {
        "tokens": tokens,
        "prefill_s": prefill_s,
        "decode_s": time.perf_counter() - start,
        "new_tokens": len(tokens),
        "kv_bytes": kv_bytes,
        "needle_survival": survival,
    }


# -- shared prefill: one forward per sample, every policy compressed from it ---------------------


class _Recorder(Policy):
    """Records each layer's prefill inputs and keeps everything."""

    ratio = 0.0
    name = "record"

    def __init__(self):
        self.inputs: dict[int, LayerInputs] = {}

    def plan(self, inputs: LayerInputs, must_keep=None) -> Plan:
        self.inputs[inputs.layer_idx] = inputs
        # everything packed (a plan with full_width_from=0 fails in CompressedLayer._store)
        everything = inputs.head_valid.clone()
        return Plan(keep=everything, channels=None, full_width_from=inputs.num_tokens)


@dataclass
class SharedPrefill:
    """One exact prefill of a sample: every layer's queries, keys and values, and the logits of
    its last token. The prefill of a causal model does not depend on what is evicted afterwards,
    so every policy's cache can be built from it, for the whole prompt or any prefix of it."""

    inputs: dict[int, LayerInputs]
    logits: torch.Tensor
    seconds: float
    input_ids: torch.Tensor
    #: KVzip's reconstruction attention per (prefix length, chunk size, overlap), per layer
    replays: dict[tuple[int, int, int], list[torch.Tensor]] = field(default_factory=dict)
    replay_seconds: dict[tuple[int, int, int], float] = field(default_factory=dict)
    #: seconds of reconstruction the last :meth:`cache` reused instead of running
    reused_replay_s: float = 0.0

    @classmethod
    @torch.no_grad()
    def run(cls, model, ids: torch.Tensor) -> SharedPrefill:
        recorder = _Recorder()
        was_enabled = kvpatch.is_enabled(model)
        if not was_enabled:
            kvpatch.enable(model)
        try:
            cache = CompressedDynamicCache(config=model.config, policy=recorder)
            start = time.perf_counter()
            argument = compat.cache_argument(model)
            out = model(ids, use_cache=True, logits_to_keep=1, **{argument: cache})
            seconds = time.perf_counter() - start
        finally:
            if not was_enabled:
                kvpatch.disable(model)
        return cls(recorder.inputs, out.logits, seconds, ids)

    def cache(self, model, policy: str | None, length: int | None = None, tokenizer=None):
        """A cache holding the first ``length`` tokens, compressed with ``policy`` (None: a stock
        ``DynamicCache``), as a prefill of those tokens would have left it. A KVzip policy
        reconstructs that prefix once (``tokenizer`` gives its prompt); other ratios reuse it."""
        if policy is None:
            cache = DynamicCache(config=model.config)
        else:
            cache = CompressedDynamicCache(config=model.config, policy=policy)
        length = length or self.input_ids.shape[1]
        self.reused_replay_s = 0.0
        deferred = policy is not None and cache.policy.needs_all_layers
        for index, layer in enumerate(cache.layers):
            inputs = self.inputs[index]
            if length < inputs.num_tokens:
                inputs = dataclasses.replace(
                    inputs,
                    queries=inputs.queries[:, :, :length],
                    keys=inputs.keys[:, :, :length],
                    values=inputs.values[:, :, :length],
                    valid=inputs.valid[..., :length],
                )
            layer.update(inputs.keys, inputs.values)
            if isinstance(layer, CompressedLayer):
                if deferred:
                    layer.defer(cache.policy, inputs)
                else:
                    layer.compress(cache.policy, inputs)
        if deferred and cache.policy.needs_replay:
            self._replay(model, cache, length, tokenizer)
        if deferred:
            cache.compress_deferred()
        return cache

    def _replay(self, model, cache: CompressedDynamicCache, length: int, tokenizer) -> None:
        scorer = replay.replay_scorer(cache.policy)
        key = (length, scorer.chunk_size, scorer.overlap)
        if key not in self.replays:
            ids = self.input_ids[:, :length]
            start = time.perf_counter()
            prompts = replay.RepeatPrompts(tokenizer, ids.device)
            replay.reconstruct(model, cache, ids, torch.ones_like(ids), prompts, scorer)
            self.replay_seconds[key] = time.perf_counter() - start
            self.replays[key] = [layer.replay_attention for layer in cache.deferred_layers]
        else:
            self.reused_replay_s = self.replay_seconds[key]
        for layer, attention in zip(cache.deferred_layers, self.replays[key], strict=True):
            layer.replay_attention = attention


@torch.no_grad()
def answer_shared(
    model,
    sample: Sample,
    prefill: SharedPrefill,
    policy: str | None,
    mode: str,
    max_new_tokens: int,
    stop=None,
    tokenizer=None,
    context_cache=None,
) -> dict:
    """Like :func:`answer`, with the cache built from a :class:`SharedPrefill` of the prompt (or
    a copy of ``context_cache``, built from it before)."""
    ids = sample.input_ids[None].to(model.device)
    split = sample.context_ids.shape[0] if mode == "agnostic" else ids.shape[1]
    start, reused = time.perf_counter(), 0.0
    if context_cache is not None:
        cache = copy.deepcopy(context_cache)
    else:
        cache = prefill.cache(model, policy, split, tokenizer)
        reused = prefill.reused_replay_s  # a reconstruction shared with another ratio
    compress_s = time.perf_counter() - start + reused
    logits = prefill.logits if split == ids.shape[1] else None
    if policy is not None and not kvpatch.is_enabled(model):
        kvpatch.enable(model)
    # the prefill's forward is shared: its time (scaled to this prefix) plus compression
    prefill_s = prefill.seconds * split / ids.shape[1] + compress_s
    return _answer_from(model, sample, ids, split, cache, logits, prefill_s, max_new_tokens, stop)


@torch.no_grad()
def build_context(model, sample: Sample, policy: str | None, tokenizer=None):
    """The cache of ``sample``'s context alone: compressed with ``policy`` (:func:`kvpatch.prefill`)
    or, for None, a full ``DynamicCache``."""
    ids = sample.context_ids[None].to(model.device)
    if policy is not None:
        return kvpatch.prefill(model, ids, policy=policy, tokenizer=tokenizer).cache
    cache = DynamicCache(config=model.config)
    model(ids, use_cache=True, logits_to_keep=1, **{compat.cache_argument(model): cache})
    return cache


def _context_cache(model, sample: Sample, spec, prefill: SharedPrefill | None, tokenizer):
    """The (compressed) cache of ``sample``'s context, built once for every question about it,
    and the seconds it took (a reconstruction reused from another ratio included)."""
    start = time.perf_counter()
    reused = 0.0
    if sample.turns:
        cache = build_chat(model, sample, spec, tokenizer)
    elif prefill is not None:
        cache = prefill.cache(model, spec, sample.context_ids.shape[0], tokenizer)
        reused = prefill.reused_replay_s
    else:
        cache = build_context(model, sample, spec, tokenizer)
    return cache, time.perf_counter() - start + reused


@torch.no_grad()
def build_chat(model, sample: Sample, policy: str | None, tokenizer=None):
    """The cache of a conversation's history, compressed with ``policy`` turn by turn: the first
    turn by :func:`kvpatch.prefill`, each later one by :meth:`~kvpatch.CompressedContext.extend`
    (None: a full ``DynamicCache``)."""
    if policy is None:
        return build_context(model, sample, None)
    ids = sample.context_ids[None].to(model.device)
    context = kvpatch.prefill(model, ids[:, : sample.turns[0]], policy=policy, tokenizer=tokenizer)
    for start, end in itertools.pairwise(sample.turns):
        context = context.extend(ids[:, start:end], tokenizer=tokenizer)
    return context.cache


def context_groups(samples: list[Sample]) -> list[list[tuple[int, Sample]]]:
    """``(index, sample)`` pairs grouped by the context they ask about, in order."""
    groups: dict[int, list[tuple[int, Sample]]] = defaultdict(list)
    for index, sample in enumerate(samples):
        groups[sample.context].append((index, sample))
    return list(groups.values())


# -- the whole evaluation ------------------------------------------------------------------------


def run_eval(config: EvalConfig, model=None, codec: Codec | None = None) -> dict:
    """Run everything in ``config``; returns ``{"config", "summary", "records"}`` and writes the
    table (``results.md``), ``results.csv``, ``results.json`` and ``results.png`` to
    ``config.output``."""
    if model is None:
        model, codec = load_model(config.model, config.attn_implementation, config.dtype)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    samples = make_samples(
        config.tasks, codec, config.context_tokens, config.samples, config.seed,
        digits=config.digits,
    )  # fmt: skip
    runs = [(FULL, 0.0)] + [
        (policy, ratio) for policy in config.policies for ratio in config.ratios
    ]
    total = len(runs) * len(config.modes) * len(samples)
    progress = _progress(total, config.progress)
    records = []
    was_enabled = kvpatch.is_enabled(model)

    def record(index, sample, mode, policy, ratio, spec, result):
        text = codec.decode(result.pop("tokens"))
        records.append(
            {
                "task": sample.task,
                "mode": mode,
                "policy": policy,
                "ratio": ratio,
                "spec": spec or FULL,
                "sample": index,
                "context": sample.context,
                "depth": round(sample.depth, 4),
                "expected": " ".join(sample.answers),
                "answer": text.strip(),
                "score": sample.score(text),
                "prompt_tokens": int(sample.input_ids.shape[0]),
                **result,
            }
        )
        progress.update(1)

    def stop_for(sample):
        start = int(sample.input_ids.shape[0])
        return _AnswerComplete(codec, start, len(sample.answers), config.digits)

    tokenizer = codec.tokenizer if isinstance(codec, HFCodec) else codec  # for KVzip's prompt
    try:
        if not was_enabled:
            kvpatch.enable(model)  # stock attention on stock caches; each cache its policy
        for indexed in context_groups(samples):
            group = [sample for _, sample in indexed]
            if config.shared_prefill:
                asked = group if "prefill" in config.modes else group[:1]
                prefills = [
                    SharedPrefill.run(model, s.input_ids[None].to(model.device)) for s in asked
                ]
            for mode in config.modes:
                for policy, ratio in runs:
                    spec = None if policy == FULL else with_ratio(policy, ratio)
                    context_cache, context_s = None, 0.0
                    # one compressed context, copied for each question; a chat turn by turn
                    if mode == "agnostic" and (len(group) > 1 or group[0].turns):
                        shared = prefills[0] if config.shared_prefill else None
                        context_cache, context_s = _context_cache(
                            model, group[0], spec, shared, tokenizer
                        )
                    for offset, (index, sample) in enumerate(indexed):
                        limit = new_tokens_for(sample, config.digits)
                        options = dict(stop=stop_for(sample), tokenizer=tokenizer)
                        if config.shared_prefill:
                            shared = prefills[offset if mode == "prefill" else 0]
                            result = answer_shared(
                                model, sample, shared, spec, mode, limit,
                                context_cache=context_cache, **options,
                            )  # fmt: skip
                        else:
                            result = answer(
                                model, sample, spec, mode, limit,
                                context_cache=context_cache, **options,
                            )  # fmt: skip
                        if context_cache is not None:
                            result["prefill_s"] += context_s
                        record(index, sample, mode, policy, ratio, spec, result)
            if config.shared_prefill:
                del prefills
    finally:
        progress.close()
        if was_enabled and not kvpatch.is_enabled(model):
            kvpatch.enable(model)
        elif not was_enabled and kvpatch.is_enabled(model):
            kvpatch.disable(model)
    records.sort(key=lambda r: (r["task"], MODES.index(r["mode"]), r["policy"] != FULL))
    summary = summarize(records)
    result = {"config": asdict(config), "summary": summary, "records": records}
    write_outputs(result, Path(config.output), plot=config.plot)
    return result


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        tqdm = None
    if tqdm is None or not enabled:

        class _Silent:
            def update(self, n: int = 1) -> None:
                pass

            def close(self) -> None:
                pass

        return _Silent()
    return tqdm(total=total, desc="kvpatch-eval", unit="run")


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, mode, policy, ratio), in the order first seen."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["task"], record["mode"], record["policy"], record["ratio"])].append(record)
    full_kv = {
        (task, mode): _mean(r["kv_bytes"] for r in rows)
        for (task, mode, policy, _), rows in groups.items()
        if policy == FULL
    }
    summary = []
    for (task, mode, policy, ratio), rows in groups.items():
        kv = _mean(r["kv_bytes"] for r in rows)
        decode_s = sum(r["decode_s"] for r in rows)
        survival = [s for r in rows if r["needle_survival"] for s in r["needle_survival"]]
        whole = [min(r["needle_survival"]) for r in rows if r["needle_survival"]]
        summary.append(
            {
                "task": task,
                "mode": mode,
                "policy": policy,
                "ratio": ratio,
                "samples": len(rows),
                "accuracy": _mean(r["score"] for r in rows),
                "kv_mb": kv / 2**20,
                "kv_saved": 1 - kv / full_kv[(task, mode)] if (task, mode) in full_kv else None,
                "prefill_s": _mean(r["prefill_s"] for r in rows),
                "decode_tok_s": sum(r["new_tokens"] for r in rows) / decode_s if decode_s else 0,
                "needle_kept": _mean(survival) if survival else None,
                "needle_min_kept": _mean(whole) if whole else None,
                "needle_kept_by_token": _mean_by_index(
                    r["needle_survival"] for r in rows if r["needle_survival"]
                ),
            }
        )
    return summary


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _mean_by_index(lists) -> list[float] | None:
    """Element-wise mean of lists that may differ in length (index i over those that have it)."""
    columns: dict[int, list[float]] = defaultdict(list)
    for values in lists:
        for index, value in enumerate(values):
            columns[index].append(value)
    return [_mean(columns[i]) for i in range(len(columns))] or None


COLUMNS = (
    ("task", "task", "{}"),
    ("mode", "question", "{}"),
    ("policy", "policy", "{}"),
    ("ratio", "ratio", "{:g}"),
    ("accuracy", "accuracy", "{:.2f}"),
    ("kv_mb", "KV MB", "{:.2f}"),
    ("kv_saved", "saved", "{:.0%}"),
    ("prefill_s", "prefill s", "{:.2f}"),
    ("decode_tok_s", "decode tok/s", "{:.1f}"),
    ("needle_kept", "needle kept", "{:.0%}"),
)


def format_table(summary: list[dict]) -> str:
    """A Markdown table of the summary rows."""
    header = [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row[key]
            cells.append("—" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_accuracy_grid(summary: list[dict]) -> str:
    """Accuracy as a policy x ratio grid per (task, mode), full cache first."""
    blocks = []
    keys = list(dict.fromkeys((r["task"], r["mode"]) for r in summary))
    ratios = sorted({r["ratio"] for r in summary if r["policy"] != FULL})
    for task, mode in keys:
        rows = [r for r in summary if (r["task"], r["mode"]) == (task, mode)]
        title = "question in prefill" if mode == "prefill" else "question-agnostic"
        lines = [f"**{task}, {title}** (accuracy)", ""]
        lines.append("| policy | " + " | ".join(f"{r:g}" for r in ratios) + " |")
        lines.append("|---|" + "---|" * len(ratios))
        for policy in dict.fromkeys(r["policy"] for r in rows):
            by_ratio = {r["ratio"]: r["accuracy"] for r in rows if r["policy"] == policy}
            if policy == FULL:
                cells = [f"{by_ratio[0.0]:.2f}"] * len(ratios)
            else:
                cells = [f"{by_ratio[x]:.2f}" if x in by_ratio else "" for x in ratios]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_needle_tokens(summary: list[dict]) -> str:
    """Per compressed run, the share of (layer, KV head) pairs that hold each token of the
    (first) expected value: which parts of a multi-token answer survive."""
    rows = [r for r in summary if r["needle_kept_by_token"]]
    if not rows:
        return ""
    width = max(len(r["needle_kept_by_token"]) for r in rows)
    header = ["task", "question", "policy", "ratio"] + [f"token {i + 1}" for i in range(width)]
    lines = [
        "**needle kept, token by token** (share of layer x KV-head pairs holding it)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        kept = [f"{value:.0%}" for value in r["needle_kept_by_token"]]
        kept += [""] * (width - len(kept))
        cells = [r["task"], r["mode"], r["policy"], f"{r['ratio']:g}", *kept]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_outputs(result: dict, output: Path, plot: bool = True) -> dict[str, Path]:
    output.mkdir(parents=True, exist_ok=True)
    paths = {}
    summary = result["summary"]
    paths["table"] = output / "results.md"
    blocks = [format_table(summary), format_accuracy_grid(summary), format_needle_tokens(summary)]
    paths["table"].write_text("\n\n".join(block for block in blocks if block) + "\n")
    paths["csv"] = output / "results.csv"
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows({key: _csv_cell(value) for key, value in row.items()} for row in summary)
    paths["json"] = output / "results.json"
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    if plot:
        png = plot_accuracy(summary, output / "results.png")
        if png is not None:
            paths["png"] = png
    return paths


def _csv_cell(value):
    """Lists (per-token shares) as one ``;``-separated cell."""
    if isinstance(value, list):
        return ";".join(f"{v:.4f}" for v in value)
    return value


def plot_accuracy(summary: list[dict], path: Path) -> Path | None:
    """Accuracy against ratio, one line per policy, one panel per (task, mode); None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = list(dict.fromkeys((r["task"], r["mode"]) for r in summary))
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4), squeeze=False, sharey=True)
    for ax, (task, mode) in zip(axes[0], keys, strict=True):
        rows = [r for r in summary if (r["task"], r["mode"]) == (task, mode)]
        policies = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != FULL]
        for policy in [FULL, *policies]:
            points = sorted((r["ratio"], r["accuracy"]) for r in rows if r["policy"] == policy)
            if policy == FULL:
                ax.axhline(points[0][1], color="black", linestyle="--", label="full cache")
                continue
            index = policies.index(policy)  # 20 colours and 4 markers: no two policies alike
            style = dict(color=plt.get_cmap("tab20")(index % 20), marker="os^D"[index // 5 % 4])
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=policy, **style)
        title = "question in prefill" if mode == "prefill" else "question-agnostic"
        ax.set_title(f"{task}, {title}")
        ax.set_xlabel("compression ratio (fraction of KV removed)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    # beside the panels: inside, it would hide the low-accuracy points
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
