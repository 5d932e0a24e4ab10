"""``kvpatch compress`` (a document compressed once, into a file) and ``kvpatch ask`` (answers
from that file, in any later process)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpatch.policies.registry import DOCUMENT_POLICY, DOCUMENT_POLICY_REASON
from kvpatch.tools.cli.conversation import COMPARE_HELP
from kvpatch.tools.loading import add_attention_option, add_model_options, add_new_tokens_option


def add_parsers(commands) -> None:
    compress = commands.add_parser(
        "compress", help="compress a document once into a file that `kvpatch ask` answers from"
    )
    compress.set_defaults(run=run_compress)
    compress.add_argument("file", help="the document, a text file")
    compress.add_argument("--out", required=True, help="the context file to write (e.g. doc.kvz)")
    add_model_options(compress, DOCUMENT_POLICY, new_tokens=False, reason=DOCUMENT_POLICY_REASON)
    ask = commands.add_parser("ask", help="answer questions from a file of `kvpatch compress`")
    ask.set_defaults(run=run_ask)
    ask.add_argument("context_file", help="a file written by kvpatch compress")
    ask.add_argument("questions", nargs="+", help="one or more questions")
    ask.add_argument("--model", help="the model (default: the one the file was compressed with)")
    ask.add_argument(
        "--compare",
        action="store_true",
        help=f"{COMPARE_HELP} (the document's tokens are in the file; it is prefilled again)",
    )
    add_attention_option(ask)
    add_new_tokens_option(ask)


def run_compress(args: argparse.Namespace) -> int:
    """Prefill the document as the pipeline would put it before a question, compress it, save it."""
    import kvpatch
    from kvpatch.pipeline import context_text
    from kvpatch.tools.loading import load_model
    from kvpatch.tools.terminal import prefill_bar, warnings_said_as

    with open(args.file, encoding="utf-8") as f:
        document = f.read()
    if not document.strip():
        raise ValueError(f"{args.file} is empty: nothing to compress")
    kvpatch.parse_policy(args.policy)
    model, tokenizer = load_model(args.model, args.attn, args.dtype)
    before, _ = context_text(tokenizer, document)
    ids = tokenizer(before, return_tensors="pt", add_special_tokens=False).input_ids
    with (
        warnings_said_as("kvpatch compress"),
        kvpatch.enabled(model, args.policy, tokenizer=tokenizer),
        prefill_bar(model, ids),
    ):
        context = kvpatch.prefill(model, ids.to(model.device), tokenizer=tokenizer)
    context.save(args.out, model=args.model)
    size = Path(args.out).stat().st_size
    stats = context.cache.stats()
    print(f"{stats.kept_note()}\n{stats}", file=sys.stderr)
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB)", file=sys.stderr)
    return 0


def run_ask(args: argparse.Namespace) -> int:
    """Answer the questions from the saved context on the model it was compressed with, each
    printed as soon as it is answered (beside the full cache's answer with ``--compare``)."""
    from transformers import pipeline

    import kvpatch
    from kvpatch.saving import read_header
    from kvpatch.tools.loading import load_model
    from kvpatch.tools.terminal import prefill_bar

    header = read_header(args.context_file)
    made_with = header["extra"].get("model", "demo")
    model, tokenizer = load_model(args.model or made_with, args.attn, header["dtype"])
    with kvpatch.enabled(model):  # the saved cache carries its policy
        context = _load(model, args, made_with)
        full = None
        if args.compare:  # the same tokens, prefilled again into a cache that keeps them all
            with prefill_bar(model, context.input_ids):
                full = kvpatch.prefill(model, context.input_ids, context.attention_mask)
        ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
        for question in args.questions:  # one at a time: each answer shows when it is ready
            print(f"Q: {question}", flush=True)
            if full is not None:
                print(f"A (full cache): {_answer(ask, full, question, args)}", flush=True)
            label = f" ({_policy_name(context.cache)})" if full is not None else ""
            print(f"A{label}: {_answer(ask, context, question, args)}\n", flush=True)
    return 0


def _load(model, args: argparse.Namespace, made_with: str):
    import kvpatch

    try:
        return kvpatch.load_context(model, args.context_file)
    except ValueError as error:
        if args.model is None or args.model == made_with:
            raise
        raise ValueError(
            f"{error}. The file was compressed with --model {made_with}: leave --model out to "
            f"answer with that model, or compress the document again with --model {args.model}"
        ) from None


def _answer(ask, context, question: str, args: argparse.Namespace) -> str:
    [answer] = ask(context=context, questions=[question], max_new_tokens=args.max_new_tokens)
    return answer["generated_text"].strip()


def _policy_name(cache) -> str:
    """The name of the policy a loaded cache was compressed with (each layer carries it)."""
    policies = [cache.policy, *(layer.policy for layer in cache.compressed_layers)]
    return next((p.name for p in policies if p is not None), "none")
