"""Many questions about one compressed context: one batch (``generate_many``) against one
question after another (``generate`` on a copy of the context each), on the random Llama of
``bench_cache.py`` and on the demo model.

For each model and context length, the context is prefilled and compressed once; then, for
N = 1, 4, 8, 16 questions of ~20 random tokens, both ways answer them with ``--new-tokens``
greedy tokens each (no early stop). The two ways alternate within each of ``--rounds`` rounds, so
that the machine's drift hits them alike; the table gives the median wall time of each way, the
speed-up (one after another / batch) against the 0.5 N target, and the KV bytes the batch holds
at its end (the context once and N tails) beside those of a batch of N copies of the context
(each copy with its question and answer, as copying the cache per row would hold).

    python -m benchmarks.bench_many_questions --models bench demo --contexts 2048 8000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvpatch
from benchmarks.bench_cache import build_model
from kvpatch import context as context_module

QUESTION_TOKENS = 20


def load(name: str):
    if name == "bench":
        return build_model()
    from kvpatch.tools import demo

    model, _ = demo.load(download=False)
    return model


def random_ids(count: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=generator) for _ in range(count)]


class SharedCaches:
    """Wraps ``share_context`` to keep the cache each ``generate_many`` built, so that its bytes
    can be read after the answers."""

    def __init__(self):
        self.real = context_module.share_context
        self.last = None

    def __call__(self, cache, rows):
        self.last = self.real(cache, rows)
        return self.last


def one_after_another(context, questions, options) -> float:
    start = time.perf_counter()
    for question in questions:
        context.generate(question, **options)
    return time.perf_counter() - start


def copy_with_answer(context, question, new_tokens: int) -> int:
    """KV bytes of one copy of the context holding a question and its answer."""
    copy = context.copy_cache()
    ids = torch.cat([question, question[:1].repeat(new_tokens)])[None]  # as many tokens
    context.model(ids, **{kvpatch.compat.cache_argument(context.model): copy})
    return copy.stats().kv_nbytes


def batched(context, questions, options, shared: SharedCaches) -> tuple[float, int]:
    start = time.perf_counter()
    context.generate_many(questions, **options)
    return time.perf_counter() - start, shared.last.stats().kv_nbytes


def run(model_name: str, length: int, args, shared: SharedCaches) -> None:
    model = load(model_name)
    vocab = model.config.vocab_size
    options = dict(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with kvpatch.enabled(model, args.policy), torch.inference_mode():
        context = kvpatch.prefill(model, random_ids(1, length, vocab, seed=1)[0][None])
        times: dict[tuple[int, str], list[float]] = {}
        held: dict[int, int] = {}
        for _ in range(args.rounds):
            for n in args.questions:
                questions = random_ids(n, QUESTION_TOKENS, vocab, seed=n)
                seconds = one_after_another(context, questions, options)
                times.setdefault((n, "alone"), []).append(seconds)
                seconds, held[n] = batched(context, questions, options, shared)
                times.setdefault((n, "batch"), []).append(seconds)
        copy = copy_with_answer(
            context, random_ids(1, QUESTION_TOKENS, vocab, 0)[0], args.new_tokens
        )
        context_mib = context.cache.stats().kv_nbytes / 2**20
        for n in args.questions:
            alone = statistics.median(times[(n, "alone")])
            batch = statistics.median(times[(n, "batch")])
            print(
                f"| {model_name} | {length} | {n} | {alone:.2f} | {batch:.2f} | "
                f"{alone / batch:.2f} | {0.5 * n:.1f} | {context_mib:.1f} | "
                f"{held[n] / 2**20:.1f} | {n * copy / 2**20:.1f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bench", "demo"], help="bench, demo")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--questions", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--policy", default="ada-snapkv:0.5")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shared = SharedCaches()
    context_module.share_context = shared
    print(f"policy {args.policy}, {args.new_tokens} new tokens per question, median of rounds")
    print(
        "| model | context | questions | one after another s | batch s | speed-up | target | "
        "context MiB | batch holds MiB | N copies hold MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models:
        for length in args.contexts:
            run(model_name, length, args, shared)


if __name__ == "__main__":
    main()
