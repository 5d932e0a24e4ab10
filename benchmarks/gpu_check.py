"""Decode speed, memory and KVzip's prefill cost on a GPU, at long contexts (run by gpu_check.sh).

A Llama-3-8B-shaped random model with fewer layers (bf16; 32 query heads sharing 8 KV heads of
128 channels) prefills ``--contexts`` random tokens at ratio ``--ratio``:

- decode: per-step time, at each of ``--batches`` (1 and 8 rows: memory-bound), of the full
  ``DynamicCache``, the *limit* (a ``DynamicCache`` of the kept tokens), and each policy, their
  ``generate`` steps interleaved and timed where they happen
  (:func:`kvpatch.tools.bench.take_turns`), medians of ``--rounds`` rounds. Each policy runs
  through the padded view the stock kernel reads (``padded``), and reading packed storage
  directly (``packed``, :mod:`kvpatch.attention.packed`, kvpatch's default: on CUDA, every head
  in one variable-length call per layer);
- memory: for each configuration alone, the cache's bytes, the memory still allocated after a
  short ``generate`` (the cache and nothing else of it) and the peak during it;
- prefill: ``global-kvzip`` (both normalisations) against a plain prefill, medians of 2.

Writes ``results.json`` (every record) and ``results.md`` (the tables) to ``--out``.
``--dry-run`` runs the same code with tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_cache import FULL, LIMIT, baseline_tokens, kvpatch_runs, measure_rounds
from kvpatch.cache import cache_nbytes
from kvpatch.tools.testing import byte_tokenizer

POLICIES = ("snapkv", "ada-snapkv", "think:0.5+snapkv")
SECTIONS = ("kernels", "decode", "memory", "prefill")
PREFILLS = ("global-kvzip:{r}/normalise=chunk", "global-kvzip:{r}/normalise=context")
#: Llama-3-8B's attention and MLP shapes
SHAPE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
)
DRY_SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=128)


def build_model(args) -> torch.nn.Module:
    return llama3_8b_shaped(args, args.layers, max(args.contexts) + 1024)


def llama3_8b_shaped(args, layers: int, positions: int) -> torch.nn.Module:
    """A random model of Llama-3-8B's shapes with ``layers`` layers (tiny ones for a dry run),
    in ``args.dtype`` on ``args.device``."""
    from kvpatch.tools.testing import tiny_model

    shape = DRY_SHAPE if args.dry_run else SHAPE
    return tiny_model(
        "llama",
        "sdpa",
        dtype=args.dtype,
        device=args.device,
        key_scale=4.0,
        num_hidden_layers=layers,
        max_position_embeddings=positions,
        pad_token_id=None,
        **shape,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: the decode groups: how compressed layers are read, and which stock sdpa kernels may run
GROUPS = (("padded", "default"), ("packed", "default"), ("padded", "no-cudnn"))


@contextlib.contextmanager
def decode_setting(device: torch.device, reading: str, kernels: str):
    """Decode steps on ``device`` read packed storage directly (``packed``) or the padded view
    through the stock kernel (``padded``); ``no-cudnn`` keeps sdpa off its cuDNN kernel."""
    from kvpatch.attention import packed as packed_attention

    saved, cudnn = packed_attention.DEVICES, torch.backends.cuda.cudnn_sdp_enabled()
    others = tuple(d for d in saved if d != device.type)
    packed_attention.DEVICES = (*others, device.type) if reading == "packed" else others
    torch.backends.cuda.enable_cudnn_sdp(cudnn and kernels != "no-cudnn")
    try:
        yield
    finally:
        packed_attention.DEVICES = saved
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def kernels(model, context: int, args) -> list[dict]:
    """Milliseconds of one stock sdpa call at a decode step (one query per head, the keys one
    longer each call, as in ``generate``), per kernel, with and without a boolean mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config, device = model.config, model.device
    heads, dim = config.num_attention_heads, config.head_dim
    query = torch.randn(1, heads, 1, dim, dtype=args.dtype, device=device)
    keys = torch.randn(1, heads, context + args.tokens, dim, dtype=args.dtype, device=device)
    names = ("flash_attention", "efficient_attention", "cudnn_attention", "math")
    backends = {"default": None, **{n: getattr(SDPBackend, n.upper()) for n in names}}
    records = []
    for name, backend in backends.items():
        for masked in (False, True):
            times = []
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    for step in range(args.tokens):
                        k = keys[:, :, : context + step]
                        shape = (1, 1, 1, k.shape[2])
                        mask = (
                            torch.ones(shape, dtype=torch.bool, device=device) if masked else None
                        )
                        synchronize(device)
                        start = time.perf_counter()
                        torch.nn.functional.scaled_dot_product_attention(
                            query, k, k, attn_mask=mask
                        )
                        synchronize(device)
                        times.append(time.perf_counter() - start)
            except RuntimeError:  # this kernel does not serve this device, dtype or mask
                times = []
            ms = statistics.median(times[1:] or times) * 1e3 if times else None
            records.append({"context": context, "kernel": name, "masked": masked, "ms": ms})
    return records


def decode(model, context: int, args) -> list[dict]:
    """Interleaved decode timings of the baselines and the policies, through the padded view,
    then reading packed storage."""
    import kvpatch

    policies = [f"{name}:{args.ratio:g}" for name in POLICIES]
    limit = f"{LIMIT}:{args.ratio:g}"
    records = []
    for batch in args.batches:
        for reading, kernel in GROUPS:
            labels = [FULL, limit, *policies]
            runs = kvpatch_runs(labels, context, args.tokens, model=model, batch=batch)
            try:
                with decode_setting(model.device, reading, kernel):
                    measured = measure_rounds(runs, context, args.rounds)
            finally:
                kvpatch.disable(model)
            group = f"{reading}, {kernel}"
            for results in measured.values():
                records += [
                    {**r, "batch": batch, "reading": group, "round": i}
                    for i, r in enumerate(results)
                ]
    return records


def memory(model, context: int, args) -> list[dict]:
    """Each configuration alone: its cache's bytes, the memory still allocated after a short
    ``generate`` while the cache lives, and the peak during it (GPU only)."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import compat

    device = model.device
    cuda = device.type == "cuda"
    labels = [FULL, f"{LIMIT}:{args.ratio:g}", *[f"{n}:{args.ratio:g}" for n in POLICIES]]
    records = []
    kvpatch.enable(model)  # each compressed cache carries its policy; DynamicCache stays stock
    try:
        for label in labels:
            baseline = label == FULL or label.startswith(LIMIT)
            tokens = baseline_tokens(label, context)
            ids = random_ids(tokens, model)
            if baseline:
                cache = DynamicCache(config=model.config)
            else:
                cache = kvpatch.CompressedDynamicCache(config=model.config, policy=label)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) if cuda else 0
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=2,
                    min_new_tokens=2,
                    do_sample=False,
                    pad_token_id=0,
                    **{compat.cache_argument(model): cache},
                )
            record = {"policy": label, "context": context, "kv_bytes": cache_nbytes(cache)}
            if cuda:
                synchronize(device)
                record["resident_bytes"] = torch.cuda.memory_allocated(device) - before
                record["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
            records.append(record)
            del cache
    finally:
        kvpatch.disable(model)
    return records


def prefill_cost(model, context: int, args) -> list[dict]:
    """``global-kvzip``'s prefill (the context's reconstruction included) against a plain one,
    interleaved; the whole-context normalisation only up to ``--kvzip-context-max`` tokens."""
    policies = [p.format(r=f"{args.ratio:g}") for p in PREFILLS]
    policies = [p for p in policies if "context" not in p or context <= args.kvzip_context_max]
    ids = random_ids(context, model)
    records = []
    for round_ in range(2):
        for policy in [FULL, *policies]:
            seconds, peak = timed_prefill(model, ids, policy)
            records.append(
                {
                    "policy": policy,
                    "context": context,
                    "round": round_,
                    "prefill_s": seconds,
                    "peak_bytes": peak,
                }
            )
    return records


def timed_prefill(model, ids: torch.Tensor, policy: str) -> tuple[float, int | None]:
    """Seconds of one prefill of ``ids`` (plain for :data:`FULL`, else ``kvpatch.prefill``) and
    its peak memory above what was allocated before (GPU only)."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch import compat

    device = model.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        if policy == FULL:
            cache = DynamicCache(config=model.config)
            model(ids, logits_to_keep=1, **{compat.cache_argument(model): cache})
        else:
            kvpatch.enable(model, policy, tokenizer=byte_tokenizer(chat_template=False))
            try:
                kvpatch.prefill(model, ids)
            finally:
                kvpatch.disable(model)
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated(device) - before) if cuda else None


def random_ids(tokens: int, model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 4096, (1, tokens), generator=generator).to(model.device)


def environment(args) -> dict:
    import transformers

    import kvpatch

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "date": datetime.date.today().isoformat(),
        "device": name or device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpatch": kvpatch.__version__,
        "commit": args.commit,
        "dtype": str(args.dtype).removeprefix("torch."),
        "layers": args.layers,
        "ratio": args.ratio,
        "tokens": args.tokens,
        "rounds": args.rounds,
    }


def median_ratio(records: list[dict], baseline: list[dict], key: str) -> float:
    """The median over rounds of ``key`` over the baseline's in the same round."""
    by_round = {r["round"]: r[key] for r in baseline}
    return statistics.median(r[key] / by_round[r["round"]] for r in records)


def decode_table(records: list[dict]) -> list[str]:
    lines = [
        "| context | batch | reading | configuration | KV MiB | ms / step | decode / full | "
        "decode / limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["context"], r["batch"], r["reading"], r["policy"]), []).append(r)
    for (context, batch, reading, policy), results in groups.items():
        full = groups[(context, batch, reading, FULL)]
        limit = next(
            v
            for (c, b, g, p), v in groups.items()
            if (c, b, g) == (context, batch, reading) and p.startswith(LIMIT)
        )
        ms = statistics.median(r["decode_s"] for r in results) * 1e3
        lines.append(
            f"| {context} | {batch} | {reading} | {policy} | "
            f"{results[0]['kv_bytes'] / 2**20:.1f} | "
            f"{ms:.2f} | {median_ratio(results, full, 'decode_s'):.2f} | "
            f"{median_ratio(results, limit, 'decode_s'):.2f} |"
        )
    return lines


def memory_table(records: list[dict]) -> list[str]:
    lines = [
        "| context | configuration | KV MiB | allocated after generate, MiB | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        resident, peak = (
            f"{r[k] / 2**20:.0f}" if k in r else "-" for k in ("resident_bytes", "peak_bytes")
        )
        lines.append(
            f"| {r['context']} | {r['policy']} | {r['kv_bytes'] / 2**20:.1f} | {resident} | "
            f"{peak} |"
        )
    return lines


def kernel_table(records: list[dict]) -> list[str]:
    lines = ["| context | sdpa kernel | ms, no mask | ms, boolean mask |", "|---|---|---|---|"]
    for plain, masked in zip(records[::2], records[1::2], strict=True):
        cells = (f"{r['ms']:.3f}" if r["ms"] is not None else "-" for r in (plain, masked))
        lines.append(f"| {plain['context']} | {plain['kernel']} | {' | '.join(cells)} |")
    return lines


def prefill_table(records: list[dict]) -> list[str]:
    lines = ["| context | prefill | seconds | / plain | peak MiB |", "|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["context"], r["policy"]), []).append(r)
    for (context, policy), results in groups.items():
        plain = groups[(context, FULL)]
        seconds = statistics.median(r["prefill_s"] for r in results)
        peaks = [r["peak_bytes"] for r in results if r["peak_bytes"] is not None]
        peak = f"{max(peaks) / 2**20:.0f}" if peaks else "-"
        ratio = median_ratio(results, plain, "prefill_s")
        lines.append(f"| {context} | {policy} | {seconds:.3f} | {ratio:.2f} | {peak} |")
    return lines


def write_report(out: Path, env: dict, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"environment": env, **results}, indent=1))
    header = ", ".join(f"{k} {v}" for k, v in env.items())
    sections = [
        f"kvpatch GPU check: {header}",
        "",
        "One stock sdpa call at a decode step (median over the steps):",
        "",
        *kernel_table(results["kernels"]),
        "",
        "Decode (steps interleaved, medians of the rounds; ratios within a round):",
        "",
        *decode_table(results["decode"]),
        "",
        "Memory (each configuration alone, a 2-token generate):",
        "",
        *memory_table(results["memory"]),
        "",
        "Prefill cost (medians of 2):",
        "",
        *prefill_table(results["prefill"]),
        "",
    ]
    (out / "results.md").write_text("\n".join(sections))


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8], help="rows decoded together"
    )
    parser.add_argument("--kvzip-context-max", type=int, default=32768)
    parser.add_argument("--commit", default="unknown", help="the commit measured (for the report)")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to measure"
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, fp32, on the CPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.contexts, args.tokens, args.rounds = "cpu", [256, 512], 4, 1
        args.batches = [1, 2]
        args.layers, args.kvzip_context_max = 2, 256
    args.dtype = torch.float32 if args.dry_run else torch.bfloat16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build_model(args)
    sections = {"kernels": kernels, "decode": decode, "memory": memory, "prefill": prefill_cost}
    results: dict[str, list[dict]] = {name: [] for name in sections}
    for context in args.contexts:
        for section in args.sections:
            measure = sections[section]
            started = time.perf_counter()
            results[section] += measure(model, context, args)
            print(f"{section} at {context}: {time.perf_counter() - started:.1f} s", flush=True)
        write_report(args.out, environment(args), results)  # what a time limit leaves is kept
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
