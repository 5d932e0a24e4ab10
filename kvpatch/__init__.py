"""kvpatch: KV-cache compression for Hugging Face transformers that really frees memory.

>>> import kvpatch
>>> kvpatch.enable(model, "think+snapkv")
>>> model.generate(**inputs)

Importing kvpatch changes nothing in transformers until ``enable``, except that it registers the
``"kvpatch-text-generation"`` pipeline (:mod:`kvpatch.pipeline`).
"""

from kvpatch.cache import (
    CacheStats,
    CompressedDynamicCache,
    CompressedLayer,
    Quantization,
    cache_nbytes,
)
from kvpatch.chat import ChatSession
from kvpatch.context import CompressedContext, load_context, prefill
from kvpatch.feed import ShortContextWarning
from kvpatch.patching import disable, enable, enabled, is_enabled
from kvpatch.pipeline import CompressedQAPipeline
from kvpatch.pipeline import register as _register_pipeline
from kvpatch.policies import (
    DEFAULT_POLICY,
    TOVA,
    AdaKV,
    ExpectedAttention,
    GlobalBudgets,
    KeyDiff,
    Knorm,
    KVzip,
    KVzipPlus,
    Policy,
    Pyramid,
    RandomScorer,
    SnapKV,
    Spans,
    SpanSnapKV,
    SpanTOVA,
    StreamingLLM,
    ThinK,
    ThinKValues,
    parse_policy,
    policy_names,
)
from kvpatch.shared_prefill import SharedPrefill

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_POLICY",
    "TOVA",
    "AdaKV",
    "CacheStats",
    "ChatSession",
    "CompressedContext",
    "CompressedDynamicCache",
    "CompressedLayer",
    "CompressedQAPipeline",
    "ExpectedAttention",
    "GlobalBudgets",
    "KVzip",
    "KVzipPlus",
    "KeyDiff",
    "Knorm",
    "Policy",
    "Pyramid",
    "Quantization",
    "RandomScorer",
    "SharedPrefill",
    "ShortContextWarning",
    "SnapKV",
    "SpanSnapKV",
    "SpanTOVA",
    "Spans",
    "StreamingLLM",
    "ThinK",
    "ThinKValues",
    "cache_nbytes",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "load_context",
    "parse_policy",
    "policy_names",
    "prefill",
]

_register_pipeline()
