r"""What each attention module of an enabled model reads in its current forward: its hidden
states (after the layer's input norm), for policies that score tokens from them.

A forward pre-hook (:func:`record`, set by :func:`kvpatch.enable`) keeps a reference, no copy;
the module's kvpatch attention call :func:`take`\ s it, so nothing outlives the forward.
"""

from __future__ import annotations

import weakref

import torch

_hidden: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module: keep its hidden states until its attention
    call."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if isinstance(hidden, torch.Tensor):
        _hidden[module] = hidden


def take(module: torch.nn.Module) -> torch.Tensor | None:
    """The hidden states ``module`` read in this forward (``[batch, tokens, hidden]``), forgotten
    here; None without the hook."""
    return _hidden.pop(module, None)
