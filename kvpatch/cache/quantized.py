"""Integer storage of packed keys and values, KIVI-style (https://arxiv.org/abs/2402.02750).

Keys have outlier *channels*, values outlier *tokens*, so keys are quantized per channel (one
scale and offset per channel for each group of ``key_group`` consecutive tokens of a head) and
values per token (one scale and offset per token). Both are asymmetric min-max quantizations to
``bits`` (8 or 4; two 4-bit codes share a byte). Scales and offsets are stored in the model's
dtype. The newest tokens stay at full precision in the layer's tail (the residual window).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BITS = (8, 4)


@dataclass(frozen=True)
class Quantization:
    """How the packed part of a compressed layer is stored.

    Parameters
    ----------
    bits : 8 or 4
    key_group : tokens of one head that share each key channel's scale and offset; by default
        128 at 8 bits, 32 at 4 bits (KIVI's group).
    residual : newest prefill tokens kept at full precision (when every head keeps them and the
        policy prunes no channels; a ThinK window is full precision already); by default 32 at
        8 bits, 128 at 4 bits (KIVI's residual).
    """

    bits: int
    key_group: int | None = None
    residual: int | None = None

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"quantization bits must be one of {BITS}, got {self.bits!r}")
        coarse = self.bits == 8  # 4-bit codes need finer groups and a longer residual
        if self.key_group is None:
            object.__setattr__(self, "key_group", 128 if coarse else 32)
        if self.residual is None:
            object.__setattr__(self, "residual", 32 if coarse else 128)
        for name, least, kind in (
            ("key_group", 1, "a positive"),
            ("residual", 0, "a non-negative"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"quantization {name} must be {kind} integer, got {value!r}")

    @classmethod
    def parse(cls, spec: str | int | Quantization | None) -> Quantization | None:
        """``"int8"``, ``"int4"``, 8, 4, a :class:`Quantization`, or None (full precision)."""
        if spec is None or isinstance(spec, Quantization):
            return spec
        names = {"int8": 8, "int4": 4}
        if isinstance(spec, str) and spec in names:
            return cls(names[spec])
        if isinstance(spec, int) and not isinstance(spec, bool) and spec in BITS:
            return cls(spec)
        raise ValueError(
            f"unknown quantization {spec!r}; choose 'int8', 'int4' (or 8, 4), or None for full "
            "precision"
        )


@dataclass
class QuantizedRows:
    """``[tokens, width]`` rows stored as ``bits``-bit codes with scales and offsets.

    ``scale``/``offset`` are ``[tokens, 1]`` for per-token rows, ``[batch, kv_heads, groups,
    width]`` for per-channel rows (group ``g`` of a head covers its tokens ``g * group`` to
    ``(g + 1) * group``).
    """

    codes: torch.Tensor  # uint8 [tokens, ceil(width * bits / 8)]
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    width: int
    group: int | None  # tokens per per-channel group; None for per-token rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.width)

    @property
    def per_channel(self) -> bool:
        return self.group is not None

    def dequantize(self, lengths: torch.Tensor) -> torch.Tensor:
        """The rows in the model's dtype; ``lengths`` ``[batch, kv_heads]`` are the tokens of each
        head, in packing order."""
        codes = _unpack(self.codes, self.bits, self.width).to(self.scale.dtype)
        if not self.per_channel:
            return torch.addcmul(self.offset, codes, self.scale)
        # each (head, group) slot's scale repeated over its tokens: the groups of a head are
        # full but the last, and packing order is head-major
        first = torch.arange(self.scale.shape[2], device=lengths.device) * self.group
        counts = (lengths[..., None] - first).clamp(0, self.group).flatten()
        tokens = codes.shape[0]
        scale = self.scale.flatten(0, 2).repeat_interleave(counts, dim=0, output_size=tokens)
        offset = self.offset.flatten(0, 2).repeat_interleave(counts, dim=0, output_size=tokens)
        return torch.addcmul(offset, codes, scale)

    def select(self, index: torch.Tensor, rows: torch.Tensor) -> QuantizedRows:
        """The tokens ``index`` of batch rows ``rows`` (whole heads, in order)."""
        pick = (lambda t: t[rows]) if self.per_channel else (lambda t: t[index])
        return replace(
            self, codes=self.codes[index], scale=pick(self.scale), offset=pick(self.offset)
        )

    def to(self, device: torch.device | str) -> QuantizedRows:
        move = lambda t: t.to(device, non_blocking=True)
        return replace(
            self, codes=move(self.codes), scale=move(self.scale), offset=move(self.offset)
        )

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.offset


def quantize_per_token(rows: torch.Tensor, bits: int) -> QuantizedRows:
    """Rows ``[tokens, width]`` with one scale and offset per token (values)."""
    low = rows.amin(dim=-1, keepdim=True)
    high = rows.amax(dim=-1, keepdim=True)
    scale, offset = _scale_offset(low, high, bits, rows.dtype)
    codes = _codes(rows, scale, offset, bits)
    return QuantizedRows(codes, scale, offset, bits, rows.shape[-1], None)


def quantize_per_channel(
    rows: torch.Tensor, lengths: torch.Tensor, bits: int, group: int
) -> QuantizedRows:
    """Rows ``[tokens, width]`` of the heads ``lengths`` ``[batch, kv_heads]`` (in packing order)
    with one scale and offset per channel for each ``group`` tokens of a head (keys)."""
    b, h = lengths.shape
    width = rows.shape[-1]
    groups = max(1, -(-int(lengths.max()) // group)) if lengths.numel() else 1
    index = _group_index(lengths, group, groups)[:, None].expand_as(rows)
    slots = b * h * groups
    low = rows.new_full((slots, width), torch.inf).scatter_reduce_(0, index, rows, "amin")
    high = rows.new_full((slots, width), -torch.inf).scatter_reduce_(0, index, rows, "amax")
    low, high = low.nan_to_num(0.0, 0.0, 0.0), high.nan_to_num(0.0, 0.0, 0.0)  # empty groups
    scale, offset = _scale_offset(low, high, bits, rows.dtype)
    codes = _codes(rows, scale[index[:, 0]], offset[index[:, 0]], bits)
    shape = (b, h, groups, width)
    return QuantizedRows(codes, scale.view(shape), offset.view(shape), bits, width, group)


def _group_index(lengths: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    """The flat (head, group) slot of every packed token."""
    counts = lengths.flatten()
    heads = torch.arange(counts.numel(), device=counts.device)
    head = torch.repeat_interleave(heads, counts)
    start = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    position = torch.arange(head.numel(), device=counts.device) - start
    return head * groups + position // group


def _scale_offset(low, high, bits: int, dtype: torch.dtype):
    """Scale and offset in ``dtype`` (the codes are computed from the rounded ones, so that
    decoding gives back the grid the codes were chosen on)."""
    levels = 2**bits - 1
    scale = ((high.float() - low.float()) / levels).clamp_min(torch.finfo(dtype).tiny)
    return scale.to(dtype), low.to(dtype)


def _codes(rows, scale, offset, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    codes = ((rows.float() - offset.float()) / scale.float()).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(codes: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    if bits == 8:
        return codes
    both = torch.stack([codes & 15, codes >> 4], dim=-1)
    return both.view(codes.shape[0], 2 * codes.shape[1])[:, :width]  # no -1: may hold no rows
