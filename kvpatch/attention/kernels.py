"""Which kernels kvpatch's attention calls use, chosen here rather than left to a dispatcher.

- Tiles: a reconstruction chunk's weights are computed a block of queries at a time, the block
  sized for the device: a few MiB on a CPU (its caches), a slice of the free memory on a GPU,
  where a small tile is a launch for little work (:func:`workspace_elements`).
- Stock sdpa on CUDA runs with cuDNN's backend off (:func:`stock_kernels`): torch's default
  dispatch picks cuDNN, which builds a plan for every new key length, i.e. at every decode step
  (about 45 ms a step on an H200, docs/performance.md); flash, memory-efficient and math remain
  as the user set them. One flag, switched around each call (about a microsecond; torch's
  ``sdpa_kernel`` context costs ten, every layer of every step).
"""

from __future__ import annotations

import contextlib

import torch

#: the share of a GPU's free memory one tile of fp32 weights may take
GPU_TILE_SHARE = 1 / 16
#: at most this many elements a tile, whatever the memory (1 GiB of fp32)
MAX_TILE_ELEMENTS = 1 << 28


def workspace_elements(device: torch.device, cpu_elements: int) -> int:
    """How many fp32 elements a tile of attention weights may hold on ``device``:
    ``cpu_elements`` on a CPU (sized for its caches), else a share of the free memory."""
    if device.type != "cuda":
        return cpu_elements
    free, _ = torch.cuda.mem_get_info(device)
    return max(cpu_elements, min(MAX_TILE_ELEMENTS, int(free * GPU_TILE_SHARE) // 4))


@contextlib.contextmanager
def stock_kernels(device: torch.device):
    """The context the stock sdpa call runs in: cuDNN's backend off on CUDA, else nothing."""
    switch = device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    if switch:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        if switch:
            torch.backends.cuda.enable_cudnn_sdp(True)


def describe(device: torch.device) -> str:
    """One line for a benchmark's output: which kernels kvpatch's attention calls use."""
    if device.type != "cuda":
        return f"kernels on {device.type}: packed heads read in place; stock sdpa as dispatched"
    return (
        "kernels on cuda: packed heads in one variable-length call per layer; stock sdpa "
        "without cuDNN (it plans anew for every key length)"
    )
