"""Compression policies: what each layer keeps.

A policy is given as an object (``SnapKV(ratio=0.5, window=32)``) or as a string in the grammar
``term ("+" term)*`` with ``term = NAME [":" RATIO] ["/" FIELD "=" VALUE ("," FIELD "=" VALUE)*]``,
RATIO being the fraction removed (default 0.5) and the settings fields of the policy (or of the
token scorer it wraps), e.g. ``"snapkv:0.5/window=32,n_sink=0"``:
``"snapkv"``, ``"ada-snapkv:0.75"``, ``"think:0.25+ada-snapkv:0.75"``; up to three terms combine,
one of each kind: key channels (``think``), value channels (``think-v``) and tokens, e.g.
``"think:0.5+think-v:0.25+ada-snapkv:0.5"``. A token scorer's name
takes the prefix ``span-`` (:class:`Spans`: a kept token brings the tokens after it), then
``ada-`` (head-wise budgets in each layer), ``global-`` (one budget shared by every layer and
head) or ``pyramid-`` (layer budgets shrinking with depth): ``"ada-span-kvzip:0.75"``.
"""

from typing import TYPE_CHECKING

from kvpatch.lazy import lazy_exports
from kvpatch.policies.registry import (
    DEFAULT_POLICY,
    DOCUMENT_POLICY,
    check_policy_names,
    policy_names,
)

#: each module and the names it gives the package (the imports below, for static tools)
EXPORTS = {
    "kvpatch.policies.adakv": ("AdaKV",),
    "kvpatch.policies.base": ("ChannelSelector", "Composed", "Policy", "TokenScorer", "compose"),
    "kvpatch.policies.contract": ("LayerInputs", "Plan", "check_ratio"),
    "kvpatch.policies.expected_attention": ("ExpectedAttention",),
    "kvpatch.policies.keydiff": ("KeyDiff",),
    "kvpatch.policies.knorm": ("Knorm",),
    "kvpatch.policies.fitted_maps": ("HiddenStateMap",),
    "kvpatch.policies.kvzap": ("KVzap",),
    "kvpatch.policies.kvzip": ("KVzip", "KVzipPlus"),
    "kvpatch.policies.layer_budgets": ("GlobalBudgets",),
    "kvpatch.policies.needs": ("HiddenStateScorer", "Reconstruction", "reconstruction_of"),
    "kvpatch.policies.parse": ("parse_policy",),
    "kvpatch.policies.pyramid": ("Pyramid",),
    "kvpatch.policies.random": ("RandomScorer",),
    "kvpatch.policies.snapkv": ("SnapKV",),
    "kvpatch.policies.spans": ("Spans", "SpanSnapKV", "SpanTOVA"),
    "kvpatch.policies.streamingllm": ("StreamingLLM",),
    "kvpatch.policies.think": ("ThinK", "ThinKValues"),
    "kvpatch.policies.tova": ("TOVA",),
}
#: written out (not computed) so that static tools can follow ``from kvpatch.policies import *``
__all__ = [
    "DEFAULT_POLICY",
    "DOCUMENT_POLICY",
    "TOVA",
    "AdaKV",
    "ChannelSelector",
    "Composed",
    "ExpectedAttention",
    "GlobalBudgets",
    "HiddenStateMap",
    "HiddenStateScorer",
    "KVzap",
    "KVzip",
    "KVzipPlus",
    "KeyDiff",
    "Knorm",
    "LayerInputs",
    "Plan",
    "Policy",
    "Pyramid",
    "RandomScorer",
    "Reconstruction",
    "SnapKV",
    "SpanSnapKV",
    "SpanTOVA",
    "Spans",
    "StreamingLLM",
    "ThinK",
    "ThinKValues",
    "TokenScorer",
    "check_policy_names",
    "check_ratio",
    "compose",
    "parse_policy",
    "policy_names",
    "reconstruction_of",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)

if TYPE_CHECKING:
    from kvpatch.policies.adakv import AdaKV
    from kvpatch.policies.base import ChannelSelector, Composed, Policy, TokenScorer, compose
    from kvpatch.policies.contract import LayerInputs, Plan, check_ratio
    from kvpatch.policies.expected_attention import ExpectedAttention
    from kvpatch.policies.fitted_maps import HiddenStateMap
    from kvpatch.policies.keydiff import KeyDiff
    from kvpatch.policies.knorm import Knorm
    from kvpatch.policies.kvzap import KVzap
    from kvpatch.policies.kvzip import KVzip, KVzipPlus
    from kvpatch.policies.layer_budgets import GlobalBudgets
    from kvpatch.policies.needs import HiddenStateScorer, Reconstruction, reconstruction_of
    from kvpatch.policies.parse import parse_policy
    from kvpatch.policies.pyramid import Pyramid
    from kvpatch.policies.random import RandomScorer
    from kvpatch.policies.snapkv import SnapKV
    from kvpatch.policies.spans import Spans, SpanSnapKV, SpanTOVA
    from kvpatch.policies.streamingllm import StreamingLLM
    from kvpatch.policies.think import ThinK, ThinKValues
    from kvpatch.policies.tova import TOVA
