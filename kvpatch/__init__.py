"""kvpatch: KV-cache compression for Hugging Face transformers that really frees memory.

>>> import kvpatch
>>> kvpatch.enable(model, "think+snapkv")
>>> model.generate(**inputs)
"""

from kvpatch.cache import CompressedDynamicCache, CompressedLayer
from kvpatch.context import CompressedContext, prefill
from kvpatch.patching import disable, enable, enabled, is_enabled
from kvpatch.policies import (
    TOVA,
    AdaKV,
    ExpectedAttention,
    GlobalBudgets,
    KeyDiff,
    Knorm,
    KVzip,
    Policy,
    RandomScorer,
    SnapKV,
    Spans,
    SpanSnapKV,
    SpanTOVA,
    StreamingLLM,
    ThinK,
    parse_policy,
    policy_names,
)

__version__ = "0.1.0"

__all__ = [
    "TOVA",
    "AdaKV",
    "CompressedContext",
    "CompressedDynamicCache",
    "CompressedLayer",
    "ExpectedAttention",
    "GlobalBudgets",
    "KVzip",
    "KeyDiff",
    "Knorm",
    "Policy",
    "RandomScorer",
    "SnapKV",
    "SpanSnapKV",
    "SpanTOVA",
    "Spans",
    "StreamingLLM",
    "ThinK",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "parse_policy",
    "policy_names",
    "prefill",
]
