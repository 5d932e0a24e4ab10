"""What kvpatch knows of each attention module of an enabled model: the policy bound to it, its
rotary embedding (weakly held: a deleted model is forgotten), and the scaling its kernel uses."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from kvpatch.policies import Policy

_policies: weakref.WeakKeyDictionary[torch.nn.Module, Policy | None] = weakref.WeakKeyDictionary()
_rotary: weakref.WeakKeyDictionary[torch.nn.Module, Callable] = weakref.WeakKeyDictionary()


def bind_policy(
    module: torch.nn.Module, policy: Policy | None, rotary: Callable | None = None
) -> None:
    _policies[module] = policy
    if rotary is not None:
        _rotary[module] = rotary


def unbind_policy(module: torch.nn.Module) -> None:
    _policies.pop(module, None)
    _rotary.pop(module, None)


def policy_of(module: torch.nn.Module) -> Policy | None:
    return _policies.get(module)


def rotary_of(module: torch.nn.Module) -> Callable | None:
    return _rotary.get(module)


def scaling(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> float:
    """The scores' scale: the kernel's argument, else the module's, else ``1 / sqrt(dim)``."""
    value = kwargs.get("scaling")
    if value is None:
        value = getattr(module, "scaling", query.shape[-1] ** -0.5)
    return float(value)
