"""The kernels kvpatch's attention calls use are chosen, not left to a dispatcher: tiles sized
for the device, and stock sdpa on CUDA without cuDNN's per-length plans."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt

import kvpatch
from kvpatch.attention import kernels, reconstruction


def test_tiles_are_the_cpu_default_on_a_cpu_and_a_share_of_a_gpus_free_memory(monkeypatch):
    assert kernels.workspace_elements(torch.device("cpu"), 1 << 20) == 1 << 20
    free = {"memory": 2 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["memory"], 80 << 30))
    cuda = torch.device("cuda", 0)
    assert kernels.workspace_elements(cuda, 1 << 20) == (2 << 30) // 16 // 4
    free["memory"] = 80 << 30
    assert kernels.workspace_elements(cuda, 1 << 20) == kernels.MAX_TILE_ELEMENTS
    free["memory"] = 1 << 20  # nearly full: never below the CPU's tile
    assert kernels.workspace_elements(cuda, 1 << 20) == 1 << 20


def test_the_stock_sdpa_context_on_cuda_leaves_cudnn_out():
    enabled = lambda: (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
        torch.backends.cuda.cudnn_sdp_enabled(),
    )
    before = enabled()
    with kernels.stock_kernels(torch.device("cuda")):
        assert enabled() == (True, True, True, False)
    assert enabled() == before
    with kernels.stock_kernels(torch.device("cpu")):
        assert enabled() == before


@pytest.mark.parametrize("elements", [64, 4096])
def test_a_reconstruction_scores_alike_whatever_its_tile(elements, monkeypatch):
    """KVzip's weights computed in tiles of the size the device allows: the same budgets."""
    from kvpatch.tools.testing import byte_tokenizer, tiny_model

    tokenizer = byte_tokenizer()
    ids = prompt(120) % 200 + 1

    def kept(tile: int | None):
        if tile is not None:
            monkeypatch.setattr(reconstruction, "workspace_elements", lambda device, default: tile)
        model = tiny_model(key_scale=4.0, vocab_size=len(tokenizer))
        with kvpatch.enabled(model, "global-kvzip:0.5", tokenizer=tokenizer):
            cache = kvpatch.prefill(model, ids).cache
        return [layer.store.kept_mask() for layer in cache.compressed_layers]

    default = kept(None)
    tiled = kept(elements)
    assert all(torch.equal(a, b) for a, b in zip(default, tiled, strict=True))
