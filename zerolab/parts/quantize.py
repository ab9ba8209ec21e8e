"""Block-wise quantisation, as ZeRO++ sends weights (qwZ, int8) and gradients (qgZ, int8 or int4).

A tensor is cut into blocks of `block` elements; each block keeps one fp32 scale, its largest
magnitude / L, and each element becomes round(x / scale), an integer in [-L, L]: L = 127 for
int8, 7 for int4 (two int4 values share a byte):

    bytes:  fp32  4n     int8  n + 4 * ceil(n / block)     int4  ceil(n / 2) + 4 * ceil(n / block)
            (block 256: int8 is 0.25 + 1.6% of fp32, int4 0.125 + 1.6%)
    error:  |x - dequantize(quantize(x))| <= scale / 2 = max|x in its block| / (2L)
            (int8: / 254, int4: / 14)

A scale per block, rather than one per tensor, keeps one large weight from costing every small
one its precision.

`quantize_rows` quantises each row of a (rows, n) tensor on its own (its blocks never straddle
two rows): qgZ sends row j to rank j, and rank j must be able to dequantize its row alone.
"""

from __future__ import annotations

import torch

BLOCK = 256  # elements per scale
LEVELS = {8: 127, 4: 7}  # bits -> the largest integer used, symmetric: [-L, L]


def quantize_rows(x: torch.Tensor, bits: int = 8,
                  block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (rows, n) float -> (values, fp32 scales (rows, ceil(n / block))). values: int8
    (rows, n) for bits=8; for bits=4, two per byte, uint8 (rows, ceil(n / 2))."""
    if bits not in LEVELS:
        raise ValueError(f"bits must be one of {sorted(LEVELS)}, got {bits}")
    rows, n = x.shape
    blocks = -(-n // block)
    padded = torch.zeros(rows, blocks * block, dtype=torch.float32, device=x.device)
    padded[:, :n] = x
    padded = padded.view(rows, blocks, block)
    scales = padded.abs().amax(dim=2) / LEVELS[bits]  # (rows, blocks)
    q = torch.round(padded / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None])
    q = q.to(torch.int8).view(rows, -1)[:, :n].contiguous()  # (rows, n) in [-L, L]
    return (_pack_int4(q) if bits == 4 else q), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 8,
                    block: int = BLOCK) -> torch.Tensor:
    """The inverse: values and (rows, ceil(n / block)) scales -> (rows, n) fp32."""
    values = _unpack_int4(q, n) if bits == 4 else q  # (rows, n) int8
    rows = values.shape[0]
    padded = torch.zeros(rows, scales.shape[1] * block, dtype=torch.float32, device=q.device)
    padded[:, :n] = values
    return (padded.view(rows, -1, block) * scales[..., None]).view(rows, -1)[:, :n]


def quantize_int8(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (n,) float -> (int8 values (n,), fp32 scales (ceil(n / block),))."""
    q, scales = quantize_rows(x.reshape(1, -1), 8, block)
    return q.reshape(-1), scales.reshape(-1)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The inverse: (n,) int8 and (ceil(n / block),) scales -> (n,) fp32."""
    return dequantize_rows(q.reshape(1, -1), scales.reshape(1, -1), q.numel(), 8,
                           block).reshape(-1)


# int4: a value v in [-7, 7] is stored as v + 8 in [1, 15], four bits; element 2i in the low
# half of byte i, element 2i + 1 in the high half.

def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(rows, n) int8 in [-7, 7] -> (rows, ceil(n / 2)) uint8."""
    rows, n = q.shape
    u = torch.zeros(rows, n + n % 2, dtype=torch.uint8, device=q.device)  # odd n: a zero pad
    u[:, :n] = (q + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, ceil(n / 2)) uint8 -> (rows, n) int8."""
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=2)  # (rows, ceil(n / 2), 2)
    return (pairs.view(packed.shape[0], -1)[:, :n].to(torch.int8) - 8)
