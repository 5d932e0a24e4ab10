"""What the commands show on a terminal besides the answer: a progress bar over the prefill,
and kvpatch's own warnings said as the commands say their errors."""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from kvpatch.feed import ShortContextWarning


@contextlib.contextmanager
def prefill_bar(model, ids: torch.Tensor):
    """A progress bar on stderr over the prompt's tokens, advanced by every forward that reads
    more than one token (each chunk of a chunked prefill) and closed once they are all read, so
    that the answer streams on a line of its own; yields it (None without tqdm)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield None
        return
    bar = tqdm(total=ids.shape[1], desc="prefill", unit="tok", file=sys.stderr, leave=False)

    def advance(module, args, kwargs):
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        tokens = ids.shape[-1] if ids is not None else 0
        tokens = embeds.shape[-2] if embeds is not None and ids is None else tokens
        if bar.disable or tokens == 0:
            return
        # a one-token forward reads the prompt's remainder with the first new token: done
        bar.update(min(tokens, bar.total - bar.n) if tokens > 1 else bar.total - bar.n)
        if bar.n >= bar.total:
            bar.close()

    hook = model.get_decoder().register_forward_pre_hook(advance, with_kwargs=True)
    try:
        yield bar
    finally:
        hook.remove()
        bar.close()


@contextlib.contextmanager
def warnings_said_as(command: str):
    """Within it, kvpatch's own warnings print as ``COMMAND: warning: ...`` on stderr, without
    a source line; every other warning as Python shows it."""
    with warnings.catch_warnings():
        show = warnings.showwarning

        def said(message, category, *where, **kwargs):
            if issubclass(category, ShortContextWarning):
                print(f"{command}: warning: {message}", file=sys.stderr)
            else:
                show(message, category, *where, **kwargs)

        warnings.showwarning = said
        yield
