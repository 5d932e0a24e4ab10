"""What the commands show on a terminal besides the answer: progress bars over the prefill and
a policy's reconstruction, the decode speed without the prefill, and kvpatch's own warnings said
as the commands say their errors."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class _LayerProgress:
    """Advances a bar by a layer's share of a forward's tokens as each decoder layer finishes:
    the prompt's tokens first ("prefill", closed at 100%), then the tokens of any further forward
    over many tokens before the first decode step ("reconstruction": a policy's second pass)."""

    def __init__(self, tqdm, tokens: int, layers: int):
        self.tqdm, self.layers = tqdm, layers
        self.prefill = tqdm(total=tokens, desc="prefill", unit="tok", file=sys.stderr)
        self.reconstruction = None
        self.read = 0.0  # tokens read by the bar in progress, fractions of a forward included
        self.done = False

    def __call__(self, module, args, kwargs, output) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        tokens = hidden.shape[-2] if hidden is not None and hidden.dim() >= 2 else 0
        if self.done or tokens == 0:
            return
        if not self.prefill.disable:  # tqdm disables a closed bar
            self.read = min(self.read + tokens / self.layers, self.prefill.total)
            self._advance(self.prefill)
            if self.prefill.n >= self.prefill.total:
                self.prefill.close()  # left on screen at 100%, ended by a newline
                self.read = 0.0
        elif tokens == 1:  # a decode step
            self.close()
        else:
            if self.reconstruction is None:
                self.reconstruction = self.tqdm(desc="reconstruction", unit="tok", file=sys.stderr)
            self.read += tokens / self.layers
            self._advance(self.reconstruction)

    def _advance(self, bar) -> None:
        bar.update(round(self.read) - bar.n)

    def close(self) -> None:
        """End every bar (the prefill's at its total), before the answer is shown."""
        if not self.done:
            if not self.prefill.disable:
                self.prefill.update(self.prefill.total - self.prefill.n)
                self.prefill.close()
            if self.reconstruction is not None:
                self.reconstruction.close()
            self.done = True


@contextlib.contextmanager
def prefill_bar(model, ids: torch.Tensor):
    """Progress bars on stderr over the prompt's tokens, advanced as each decoder layer finishes
    (so that a long single-forward prefill moves too), and over a policy's reconstruction; both are
    left at 100% on lines of their own. Yields their owner (None without tqdm), whose ``close``
    a :class:`TimedStream` calls before the first new token, so that the answer starts on a
    fresh line; they are closed at the first decode step or the block's end otherwise."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield None
        return
    layers = list(model.get_decoder().layers)
    progress = _LayerProgress(tqdm, ids.shape[1], len(layers))
    hooks = [layer.register_forward_hook(progress, with_kwargs=True) for layer in layers]
    try:
        yield progress
    finally:
        for hook in hooks:
            hook.remove()
        progress.close()


class TimedStream:
    """A streamer for ``generate`` that passes every token on to ``inner`` (or to nothing) and
    notes when the first new token came: the decode speed without the prefill."""

    def __init__(self, inner=None, before_first_token=None):
        self.inner, self.before_first_token = inner, before_first_token
        self.prompt_seen = False
        self.new_tokens = 0
        self.first = self.last = 0.0

    def put(self, value) -> None:
        if self.prompt_seen:  # generate's first put is the prompt
            self.new_tokens += value.numel()
            if not self.first and self.before_first_token is not None:
                self.before_first_token()  # e.g. close the progress bars: the answer starts
            self.last = time.perf_counter()
            self.first = self.first or self.last
        self.prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

    def decode_speed(self) -> str:
        """``N tokens/s`` over the tokens after the first (which the prefill computes)."""
        if self.new_tokens < 2 or self.last <= self.first:
            return "too few tokens to time the decode"
        rate = (self.new_tokens - 1) / (self.last - self.first)
        return f"decode {rate:.1f} tokens/s"


@contextlib.contextmanager
def warnings_said_as(command: str):
    """Within it, kvpatch's own warnings print as ``COMMAND: warning: ...`` on stderr, without
    a source line; every other warning as Python shows it."""
    from kvpatch.feed import ShortContextWarning

    with warnings.catch_warnings():
        show = warnings.showwarning

        def said(message, category, *where, **kwargs):
            if issubclass(category, ShortContextWarning):
                print(f"{command}: warning: {message}", file=sys.stderr)
            else:
                show(message, category, *where, **kwargs)

        warnings.showwarning = said
        yield
