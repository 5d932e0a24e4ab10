"""A transformers cache that stores only what the policy keeps.

- :mod:`~kvpatch.cache.dynamic` — :class:`CompressedDynamicCache`, the cache users pass;
- :mod:`~kvpatch.cache.layer` — :class:`CompressedLayer`, one layer's life: dense prefill,
  compression, appending;
- :mod:`~kvpatch.cache.store` — the compressed layout: a packed part and a full-width tail;
- :mod:`~kvpatch.cache.packed` — variable-length heads, channel-pruned keys and values, back to
  back;
- :mod:`~kvpatch.cache.buffer` — the tail's storage, grown with spare room;
- :mod:`~kvpatch.cache.recompress` — compressing again: a decode budget, an appended segment, a
  prefill chunk;
- :mod:`~kvpatch.cache.reconstruction_chunk` — a reconstruction chunk's masks and workspaces;
- :mod:`~kvpatch.cache.hidden_scores` — every token's score from its hidden state;
- :mod:`~kvpatch.cache.requests` — what the layer asks of the attention function that reads its
  keys (one typed request, posted with them);
- :mod:`~kvpatch.cache.stats` — tokens and bytes held.
"""

from kvpatch.cache.dynamic import CompressedDynamicCache, check_chunk_size
from kvpatch.cache.layer import CompressedLayer
from kvpatch.cache.quantized import Quantization
from kvpatch.cache.recompress import (
    RECENT_QUERIES,
    DecodeBudget,
    bounded_history_policy,
    check_max_kv_tokens,
    token_part,
    token_policy_of,
)
from kvpatch.cache.reconstruction_chunk import LocalColumns, ReconstructionChunk
from kvpatch.cache.requests import (
    AttentionRequest,
    PackedRequest,
    PaddedRequest,
    PrefillRequest,
    ReconstructionRequest,
    peek,
    post,
    take,
)
from kvpatch.cache.stats import CacheStats, LayerStats, cache_nbytes

__all__ = [
    "RECENT_QUERIES",
    "AttentionRequest",
    "CacheStats",
    "CompressedDynamicCache",
    "CompressedLayer",
    "DecodeBudget",
    "LayerStats",
    "LocalColumns",
    "PackedRequest",
    "PaddedRequest",
    "PrefillRequest",
    "Quantization",
    "ReconstructionChunk",
    "ReconstructionRequest",
    "bounded_history_policy",
    "cache_nbytes",
    "check_chunk_size",
    "check_max_kv_tokens",
    "peek",
    "post",
    "take",
    "token_part",
    "token_policy_of",
]
