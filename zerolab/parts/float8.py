"""float8 (e4m3) with a scale: how torchtitan's FSDP2 gathers weights in half of bf16's bytes.

e4m3 is 1 sign bit, 4 exponent bits, 3 mantissa bits (torch.float8_e4m3fn): 256 codes, the
largest 448. A weight of 0.02 is far below what the format resolves well at its top, so each
value is multiplied by a *scale* first, 448 / amax, and the codes carry x * 448 / amax:

    per tensor:  one scale for a whole parameter; its amax over every rank's shard needs one
                 all-reduce (max) of a float per parameter before the gather (torchtitan's
                 precomputed dynamic scale does the same, once for all parameters)
    per block:   one scale per `block` elements of the flat shard, computed locally and
                 gathered beside the codes: 4 bytes per block more on the wire

On the wire the codes are bytes (uint8): gloo has no float8 type, and a byte is a byte.

    bytes:  float8  n + scales      bf16  2n      fp32  4n
    error:  |x - dequantize(quantize(x))| <= max(|x| / 16, amax / 448 * 2^-10)
            (3 mantissa bits: round to nearest is within half a step, 2^-4 of |x|; below the
            smallest normal, 2^-6 after scaling, the step is fixed at 2^-9, so half of it)
    bf16:   |x - bf16(x)| <= |x| / 256   (7 mantissa bits, 8 with the implicit one)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value (torch.finfo(torch.float8_e4m3fn).max)
RELATIVE_ERROR = 2.0 ** -4  # half a step of a 3-bit mantissa, relative to |x|
SUBNORMAL_ERROR = 2.0 ** -10  # half the subnormal step, 2^-9, in scaled units
BF16_RELATIVE_ERROR = 2.0 ** -8
BLOCK = 128  # elements per scale, per-block scaling (the block torchao's float8 recipes use)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax (any shape) -> the dequantizing scale amax / 448 (x ≈ code * scale). An all-zero
    block gets scale 1: its codes are all 0 whatever the scale."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (n,) float, scale (n,) or a scalar -> (n,) uint8: the e4m3 codes of x / scale."""
    scaled = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)  # rounding may pass 448 by a hair
    return scaled.to(E4M3).view(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes (n,) uint8, scale (n,) or a scalar -> (n,) fp32."""
    return codes.view(E4M3).float() * scale


def block_scales(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x (n,) -> (ceil(n / block),) fp32 scales, one per block of `block` elements."""
    if block < 1:
        raise ValueError(f"block must be a positive number of elements, got {block}")
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.detach().abs()
    return scale_of(padded.view(-1, block).amax(dim=1))


def per_element(scales: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """(blocks,) scales -> (n,) the scale of each element."""
    return scales.repeat_interleave(block)[:n]


def tensor_amax(shard: torch.Tensor, offsets: Sequence[int], numels: Sequence[int],
                start: int) -> torch.Tensor:
    """The amax of each tensor's part in a flat shard: shard (s,) holds flat elements
    [start, start + s); tensor i holds [offsets[i], offsets[i] + numels[i]). Returns (T,) fp32,
    0 for a tensor with no element in the shard. (An all-reduce of max makes it the tensor's.)"""
    end = start + shard.numel()
    out = torch.zeros(len(offsets), dtype=torch.float32, device=shard.device)
    for i, (off, numel) in enumerate(zip(offsets, numels)):
        lo, hi = max(off, start), min(off + numel, end)
        if lo < hi:
            out[i] = shard[lo - start:hi - start].detach().abs().max()
    return out


def tensor_scales(scales: torch.Tensor, offsets: Sequence[int], numels: Sequence[int],
                  start: int, end: int) -> torch.Tensor:
    """(T,) per-tensor scales -> (end - start,) the scale of each flat element in [start, end);
    padding (no tensor's) gets 1: it is zero, and stays zero."""
    out = torch.ones(end - start, dtype=torch.float32, device=scales.device)
    for s, off, numel in zip(scales, offsets, numels):
        lo, hi = max(off, start), min(off + numel, end)
        if lo < hi:
            out[lo - start:hi - start] = s
    return out


def error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(n,) the largest |x - dequantize(quantize(x, scale), scale)| the format allows."""
    return torch.maximum(x.abs() * RELATIVE_ERROR, scale * SUBNORMAL_ERROR)


def float8_bytes(numel: int, scales: int) -> int:
    """Bytes of `numel` e4m3 codes and `scales` fp32 scales."""
    return numel + 4 * scales
