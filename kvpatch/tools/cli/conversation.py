"""``kvpatch generate`` (one prompt, the answer streamed) and ``kvpatch chat`` (a conversation
on one compressed cache); ``--compare`` puts the full cache's answer beside the compressed one."""

from __future__ import annotations

import argparse
import sys

from kvpatch.policies.registry import DEFAULT_POLICY
from kvpatch.tools.loading import add_model_options

#: ``kvpatch chat``'s history bound, tokens per head
CHAT_BUDGET = 2048
#: why :data:`DEFAULT_POLICY` is the default
DEFAULT_REASON = "no extra pass, and facts kept whether the question comes first or later"
CHAT_HELP = "/stats: KV bytes held · /policy NAME: compress with NAME · /reset · /quit"
COMPARE_HELP = (
    "also answer with the full (uncompressed) cache, to tell the model's own mistakes from the "
    "compression's"
)


def add_parsers(commands) -> None:
    generate = commands.add_parser("generate", help="one prompt, the answer streamed")
    generate.set_defaults(run=run_generate)
    generate.add_argument("prompt", nargs="?", help="the prompt (or --prompt-file)")
    generate.add_argument("--prompt-file", help="read the prompt from this file")
    generate.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="send the prompt as it is (default: in the model's chat template, as a user turn; "
        "a model without one continues the prompt as written)",
    )
    generate.add_argument(
        "--prefill-chunk",
        type=int,
        help="prefill in chunks of this many tokens, compressing after each (default: at once)",
    )
    generate.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="store the kept tokens as integers (default: in the model's dtype)",
    )
    generate.add_argument("--compare", action="store_true", help=COMPARE_HELP)
    add_model_options(generate, DEFAULT_POLICY, reason=DEFAULT_REASON)
    chat = commands.add_parser(
        "chat", help="a conversation on one compressed cache; turns from stdin, one per line"
    )
    chat.set_defaults(run=run_chat)
    add_model_options(chat, DEFAULT_POLICY, reason=DEFAULT_REASON)
    chat.add_argument(
        "--max-kv-tokens",
        type=int,
        default=CHAT_BUDGET,
        help="keep each turn whole and the history within this many tokens per head, the older "
        "turns compressed with the policy's scorer (default %(default)s: the length the demo "
        "model's accuracy is measured at; 0: compress each turn at the policy's ratio instead)",
    )
    chat.add_argument("--compare", action="store_true", help=COMPARE_HELP)


def _prompt_text(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give the prompt as an argument or with --prompt-file (one of them)")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return args.prompt


def prompt_ids(tokenizer, text: str, chat_template: bool = True):
    """``text`` as the model is asked it: in the chat template as a user turn where there is one
    and ``chat_template`` is set, else as written after the BOS the tokenizer adds."""
    from kvpatch.chat import render

    # a base model (no chat template) continues the prompt as written, as the eval's completion
    # format does; a made-up "User:/Assistant:" frame would only make it echo the prompt
    templated = chat_template and bool(getattr(tokenizer, "chat_template", None))
    if templated:
        text = render(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    # a chat template writes its own BOS; plain text gets the one the tokenizer adds (Gemma's)
    return tokenizer(text, return_tensors="pt", add_special_tokens=not templated).input_ids


def run_generate(args: argparse.Namespace) -> int:
    """Stream the answer to stdout; what the cache kept, its bytes and the speed to stderr."""
    import kvpatch
    from kvpatch.tools.loading import load_model
    from kvpatch.tools.terminal import warnings_said_as

    text = _prompt_text(args)
    kvpatch.parse_policy(args.policy)  # a bad setting fails before the model loads
    model, tokenizer = load_model(args.model, args.attn, args.dtype)
    ids = prompt_ids(tokenizer, text, args.chat_template).to(model.device)
    with warnings_said_as("kvpatch generate"):
        if args.compare:
            print("full cache: ", end="", flush=True)
            full_answer(model, tokenizer, ids, args.max_new_tokens, stream=True)
            print(f"{args.policy}: ", end="", flush=True)
        _generate_compressed(args, model, tokenizer, ids)
    return 0


def _generate_compressed(args: argparse.Namespace, model, tokenizer, ids) -> None:
    import torch
    from transformers import TextStreamer

    import kvpatch
    from kvpatch.tools.terminal import TimedStream, prefill_bar

    cache = kvpatch.CompressedDynamicCache(
        config=model.config, prefill_chunk_size=args.prefill_chunk, quantize=args.quantize
    )
    text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with (
        kvpatch.enabled(model, args.policy, tokenizer=tokenizer),
        prefill_bar(model, ids) as bars,
    ):
        stream = TimedStream(text, before_first_token=bars.close if bars else None)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            streamer=stream,
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **{kvpatch.compat.cache_argument(model): cache},
        )
    new = out.shape[1] - ids.shape[1]
    stats = cache.stats()
    print(f"\n{stats.kept_note()}\n{stats}", file=sys.stderr)
    print(f"{new} tokens, {stream.decode_speed()} (prompt {ids.shape[1]} tokens)", file=sys.stderr)


def full_answer(model, tokenizer, ids, max_new_tokens: int, stream: bool = False) -> str:
    """The answer to ``ids`` with a stock, uncompressed cache (streamed to stdout if ``stream``),
    greedy as the compressed one."""
    import torch
    from transformers import DynamicCache, TextStreamer

    from kvpatch import compat
    from kvpatch.patching import suspended

    streamer = (
        TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    )
    with suspended(model):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            streamer=streamer,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **{compat.cache_argument(model): DynamicCache(config=model.config)},
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def run_chat(args: argparse.Namespace) -> int:
    """Turns from stdin, one per line; replies streamed to stdout."""
    from transformers import TextStreamer

    import kvpatch
    from kvpatch.chat import ChatSession, render
    from kvpatch.tools.loading import load_model

    budget = args.max_kv_tokens or None
    # a bad setting, or a policy that cannot bound a history, fails before the model loads
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
        if args.compare:  # the same history and question, read from an uncompressed cache
            messages = [*session.messages, {"role": "user", "content": line}]
            ids = tokenizer(
                render(tokenizer, messages, add_generation_prompt=True),
                return_tensors="pt",
                add_special_tokens=False,
            ).input_ids.to(model.device)
            print("full cache: ", end="", flush=True)
            full_answer(model, tokenizer, ids, args.max_new_tokens, stream=True)
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
