"""What fits on the card: the largest batch at a context that each cache holds, and its throughput.

A Llama-3-8B-shaped random model (:func:`benchmarks.gpu_check.llama3_8b_shaped`, all 32 layers,
bf16) prefills ``--context`` random tokens per row in chunks of ``--chunk`` (so that the
activations stay small beside the cache), then decodes ``--tokens`` tokens greedily. For each
configuration the batch doubles until a run fails for memory, then a binary search finds the
largest that runs; the table gives that batch, its cache's bytes and the tokens per second
decoded at it (all rows, the first token, which the prefill computes, apart), against the full
cache's.

Configurations: the full ``DynamicCache``, ``ada-snapkv:0.75``, ``think:0.5+ada-snapkv:0.75``
and ``ada-snapkv:0.75`` in int4 (``--ratio`` sets 0.75). ``--dry-run`` runs the same code on the
CPU with tiny shapes, a memory budget of ``--budget-mib`` standing in for the card's memory (a
run "fails" when its cache would hold more).

    python -m benchmarks.gpu_capacity --context 32768 --out gpu_check_out
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.gpu_check import llama3_8b_shaped

FULL = "full"
#: Llama-3-8B's layers (a dry run: 2)
LAYERS, DRY_LAYERS = 32, 2


class OutOfBudget(RuntimeError):
    """A dry run's cache would hold more than the budget standing in for the card's memory."""


def configurations(ratio: float) -> dict[str, dict]:
    """Each configuration's cache settings (None: the full ``DynamicCache``)."""
    heads = f"ada-snapkv:{ratio:g}"
    return {
        FULL: None,
        heads: {"policy": heads},
        f"think:0.5+{heads}": {"policy": f"think:0.5+{heads}"},
        f"{heads}@int4": {"policy": heads, "quantize": "int4"},
    }


def build_model(args) -> torch.nn.Module:
    layers = DRY_LAYERS if args.dry_run else LAYERS
    return llama3_8b_shaped(args, layers, args.context + args.tokens + 64)


def run(model, settings: dict | None, batch: int, args) -> dict:
    """Prefill ``batch`` rows of ``args.context`` tokens in chunks, decode ``args.tokens``;
    the cache's bytes and the decode throughput. Raises on running out of memory."""
    from transformers import DynamicCache

    import kvpatch
    from kvpatch.tools.terminal import TimedStream

    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, 4096, (batch, args.context + 1), generator=generator).to(args.device)
    stream = TimedStream()
    options = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    options |= dict(pad_token_id=0, streamer=stream)
    with torch.inference_mode():
        if settings is None:
            cache = DynamicCache(config=model.config)
            for start in range(0, args.context, args.chunk):
                end = min(start + args.chunk, args.context)
                model(ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1)
            _check_budget(cache, args)
            model.generate(
                ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **options
            )
        else:
            with kvpatch.enabled(model):
                context = kvpatch.prefill(model, ids[:, :-1], chunk_size=args.chunk, **settings)
                cache = context.cache
                _check_budget(cache, args)
                context.generate(ids[:, -1:], **options)
    kv_bytes = kvpatch.cache_nbytes(cache)
    _check_budget(cache, args)
    seconds = stream.last - stream.first
    tokens_per_s = batch * (stream.new_tokens // batch - 1) / seconds if seconds > 0 else 0.0
    return {"batch": batch, "kv_bytes": kv_bytes, "tokens_per_s": tokens_per_s}


def _check_budget(cache, args) -> None:
    import kvpatch

    if args.budget_mib is not None and kvpatch.cache_nbytes(cache) > args.budget_mib * 2**20:
        raise OutOfBudget(f"the cache holds more than {args.budget_mib} MiB")


def try_run(model, settings: dict | None, batch: int, args) -> dict | None:
    """:func:`run`, or None where it ran out of (the card's, or the dry run's) memory."""
    try:
        return run(model, settings, batch, args)
    except (torch.OutOfMemoryError, OutOfBudget):
        return None
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def largest_batch(model, settings: dict | None, args) -> tuple[dict | None, list[int]]:
    """The largest batch that runs (doubling, then halving the gap) and every batch tried."""
    tried, best, failed = [], None, None
    batch = 1
    while batch <= args.max_batch and failed is None:
        tried.append(batch)
        found = try_run(model, settings, batch, args)
        if found is None:
            failed = batch
        else:
            best, batch = found, batch * 2
    low = best["batch"] if best else 0
    high = failed if failed is not None else low
    while high - low > 1:
        middle = (low + high) // 2
        tried.append(middle)
        found = try_run(model, settings, middle, args)
        if found is None:
            high = middle
        else:
            best, low = found, middle
    return best, tried


def table(records: list[dict], context: int) -> list[str]:
    full = next((r for r in records if r["configuration"] == FULL and r["batch"]), None)
    lines = [
        f"Largest batch at {context} tokens a row, and its decode throughput:",
        "",
        "| configuration | batch | KV MiB | tokens / s | batch / full | tokens/s / full |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        if not r["batch"]:
            lines.append(f"| {r['configuration']} | none fits | - | - | - | - |")
            continue
        ratios = ("-", "-")
        if full:
            ratios = (
                f"{r['batch'] / full['batch']:.2f}",
                f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}",
            )
        lines.append(
            f"| {r['configuration']} | {r['batch']} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{r['tokens_per_s']:.0f} | {ratios[0]} | {ratios[1]} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="where to run (default: cuda)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="results folder")
    parser.add_argument("--context", type=int, default=32768, help="tokens a row (default 32768)")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (default 4096)")
    parser.add_argument("--tokens", type=int, default=16, help="decoded a row (default 16)")
    parser.add_argument("--ratio", type=float, default=0.75, help="share removed (default 0.75)")
    parser.add_argument("--max-batch", type=int, default=512, help="largest tried (default 512)")
    parser.add_argument("--budget-mib", type=float, default=None, help="dry run: the memory")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, fp32, on the CPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.context, args.chunk, args.tokens = "cpu", 256, 64, 4
        args.max_batch = 16
        args.budget_mib = args.budget_mib or 1.0
    args.dtype = torch.float32 if args.dry_run else torch.bfloat16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build_model(args)
    records = []
    for name, settings in configurations(args.ratio).items():
        started = time.perf_counter()
        best, tried = largest_batch(model, settings, args)
        records.append({"configuration": name, "tried": tried, **(best or {"batch": 0})})
        print(f"{name}: batch {records[-1]['batch']} ({time.perf_counter() - started:.0f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    report = {"settings": settings, "capacity": records}
    (args.out / "capacity.json").write_text(json.dumps(report, indent=1))
    (args.out / "capacity.md").write_text("\n".join(table(records, args.context)) + "\n")
    print((args.out / "capacity.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
