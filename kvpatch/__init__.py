"""kvpatch: KV-cache compression for Hugging Face transformers that really frees memory.

>>> import kvpatch
>>> kvpatch.enable(model, "think+snapkv")
>>> model.generate(**inputs)

Importing kvpatch changes nothing in transformers until ``enable``, except that the
``"kvpatch-text-generation"`` pipeline (:mod:`kvpatch.pipeline`) is registered as soon as
transformers' pipelines are imported. Its names are imported on first use (:mod:`kvpatch.lazy`).
"""

from typing import TYPE_CHECKING

import wrapt

from kvpatch import policies
from kvpatch.lazy import lazy_exports

__version__ = "0.1.0"

#: each module and the names it gives the package (the imports below, for static tools)
EXPORTS = {
    "kvpatch.cache": (
        "CacheStats",
        "CompressedDynamicCache",
        "CompressedLayer",
        "Quantization",
        "cache_nbytes",
    ),
    "kvpatch.chat": ("ChatSession",),
    "kvpatch.context": ("CompressedContext", "load_context", "prefill"),
    "kvpatch.feed": ("ShortContextWarning",),
    "kvpatch.patching": ("disable", "enable", "enabled", "is_enabled"),
    "kvpatch.pipeline": ("CompressedQAPipeline",),
    # every public name of the policies (their classes: kvpatch.policies.registry)
    "kvpatch.policies": tuple(policies.__all__),
    "kvpatch.shared_prefill": ("SharedPrefill",),
}
__all__ = sorted(name for names in EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)

if TYPE_CHECKING:
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
    from kvpatch.policies import *  # noqa: F403
    from kvpatch.shared_prefill import SharedPrefill


def _register_pipeline(_transformers_pipelines) -> None:
    # importing kvpatch.pipeline registers it; it may be importing transformers.pipelines itself
    # right now (then it registers once its own import ends)
    import kvpatch.pipeline


wrapt.register_post_import_hook(_register_pipeline, "transformers.pipelines")
