"""FP8 (E4M3FN) and NVFP4 (FP4 E2M1 values, FP8 block scales, FP32 global scale) numerics in
torch, written to match ONNX QuantizeLinear / DequantizeLinear and TensorRT bit for bit.

FP8 E4M3FN: saturating cast to +-448, round to nearest even (ONNX QuantizeLinear with
saturate=1). Values are clamped before torch's float8_e4m3fn cast: recent torch saturates on
its own, older releases turned overflow into NaN.

FP4 E2M1: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (codes 0..7) with a sign bit (code | 8).
Rounding is to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4), magnitudes above 6 saturate to 6, and the sign of a value that
rounds to zero is kept (-0.1 -> code 0x8). In torch an FP4 tensor is a uint8 tensor of codes,
one per element; `pack_fp4` makes the ONNX FLOAT4E2M1 byte layout (low nibble = even index).

NVFP4, as ModelOpt exports it and TensorRT runs it, for blocks of 16 along the reduction axis:
    s_g  = amax / (6 * 448)                         FP32 global scale (1.0 where amax is 0)
    sb8  = fp8((amax_block / 6) / s_g)              FP8 block scale, saturated at 448
    d    = float(sb8) * s_g                         the block's dequantization scale
    q    = fp4(x / d)                               (0 where d is 0: all-zero blocks)
    x^   = q * d
The dequantization order (sb8 * s_g first, then q times that) is the order of the two
chained DequantizeLinear nodes of the graph, so the products round identically.
"""
from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring levels, and whether a value exactly on the midpoint goes up:
# a tie goes to the even code (midpoint i lies between codes i and i + 1).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = tuple(i % 2 == 1 for i in range(7))


# ----------------------------------------------------------------------------- FP8

def fp8_cast(x: Tensor) -> Tensor:
    """float -> torch.float8_e4m3fn, saturating (ONNX saturate=1), round to nearest even."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_round(x: Tensor) -> Tensor:
    """The float32 value of fp8_cast(x)."""
    return fp8_cast(x).float()


def fp8_scale(amax: Tensor | float) -> Tensor:
    """Per-tensor or per-channel FP8 scale amax / 448 in float32; 1.0 where amax is 0, because
    TensorRT requires positive Q/DQ scales and a zero tensor quantizes to zeros at any scale."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def fp8_quantize(x: Tensor, scale: Tensor) -> Tensor:
    """QuantizeLinear(x, scale) to FLOAT8E4M3FN: saturate(x / scale). `scale` broadcasts."""
    return fp8_cast(x.float() / scale)


def fp8_dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """DequantizeLinear: float(q) * scale."""
    return q.float() * scale


def fp8_fake_quant(x: Tensor, scale: Tensor) -> Tensor:
    return fp8_dequantize(fp8_quantize(x, scale), scale)


def fp8_weight(w: Tensor, per_channel: bool) -> tuple[Tensor, Tensor]:
    """nn.Linear weight [out, in] -> (FP8 weight [out, in], scale [out] or scalar)."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = fp8_scale(amax)
    return fp8_quantize(w, scale[:, None] if per_channel else scale), scale


# ----------------------------------------------------------------------------- FP4 E2M1

def fp4_encode(x: Tensor) -> Tensor:
    """float -> uint8 FP4 E2M1 codes (0..15): nearest level, ties to even, saturating at 6,
    sign bit kept for values that round to zero. NaN has no encoding and is rejected."""
    x = x.float()
    if torch.isnan(x).any():
        raise ValueError("FP4 E2M1 has no NaN encoding: the tensor to quantize contains NaN")
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in zip(_FP4_MIDPOINTS, _TIE_GOES_UP):
        code += (mag >= mid if up else mag > mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def fp4_decode(codes: Tensor) -> Tensor:
    """uint8 FP4 codes -> float32 values (code 0x8 is -0.0)."""
    levels = torch.tensor(FP4_LEVELS, dtype=torch.float32, device=codes.device)
    mag = levels[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def pack_fp4(codes: Tensor) -> bytes:
    """Codes in row-major order -> ONNX FLOAT4E2M1 raw bytes: two per byte, the even-index
    element in the low nibble, an odd count padded with a zero high nibble."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat((flat, flat.new_zeros(1)))
    return ((flat[0::2] & 0xF) | ((flat[1::2] & 0xF) << 4)).numpy().tobytes()


def unpack_fp4(raw: bytes, count: int) -> Tensor:
    """Inverse of pack_fp4: the first `count` codes."""
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    codes = torch.stack((data & 0xF, data >> 4), dim=1).reshape(-1)
    if codes.numel() < count:
        raise ValueError(f"FP4 raw data holds {codes.numel()} values, {count} were expected")
    return codes[:count]


# ----------------------------------------------------------------------------- NVFP4

def nvfp4_global_scale(amax: Tensor | float) -> Tensor:
    """FP32 global scale amax / (6 * 448); 1.0 where amax is 0 (as ModelOpt does)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / (FP4_MAX * FP8_MAX), torch.ones_like(amax))


def _blocks(x: Tensor, axis: int, block: int) -> Tensor:
    """Move `axis` last and split it into [n_blocks, block]."""
    x = x.movedim(axis, -1)
    if x.shape[-1] % block:
        raise ValueError(f"NVFP4 blocks of {block} do not divide the quantized axis of length {x.shape[-1]}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblocks(x: Tensor, axis: int) -> Tensor:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1]).movedim(-1, axis)


def nvfp4_quantize(x: Tensor, global_scale: Tensor, axis: int = -1, block: int = NVFP4_BLOCK
                   ) -> tuple[Tensor, Tensor]:
    """x -> (FP4 codes, same shape as x; FP8 block scales, `axis` shortened by `block`).

    This is TRT_FP4DynamicQuantize(x, global_scale, axis, block_size, scale_type=FP8E4M3FN)."""
    g = torch.as_tensor(global_scale, dtype=torch.float32)
    xb = _blocks(x.float(), axis, block)                                   # [..., nb, block]
    sb8 = fp8_cast(xb.abs().amax(dim=-1) / FP4_MAX / g)                    # [..., nb]
    d = (sb8.float() * g)[..., None]
    safe = torch.where(d > 0, d, torch.ones_like(d))
    scaled = torch.where(d > 0, xb / safe, torch.zeros_like(xb))           # all-zero block: 0, not NaN
    codes = fp4_encode(scaled)
    return _unblocks(codes, axis), sb8.movedim(-1, axis)


def nvfp4_dequantize(codes: Tensor, block_scales: Tensor, global_scale: Tensor, axis: int = -1,
                     block: int = NVFP4_BLOCK) -> Tensor:
    """The two chained DequantizeLinear nodes: d = float(sb8) * s_g; x^ = fp4(code) * d."""
    d = block_scales.float() * torch.as_tensor(global_scale, dtype=torch.float32)
    d = d.movedim(axis, -1)[..., None]
    values = _blocks(fp4_decode(codes), axis, block)
    return _unblocks(values * d, axis)


def nvfp4_fake_quant(x: Tensor, global_scale: Tensor, axis: int = -1) -> Tensor:
    codes, sb8 = nvfp4_quantize(x, global_scale, axis)
    return nvfp4_dequantize(codes, sb8, global_scale, axis)


def nvfp4_weight(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """nn.Linear weight [out, in] -> (FP4 codes [out, in], FP8 block scales [out, in / 16],
    global scale), blocks along `in`, the reduction axis."""
    w = w.detach().float()
    g = nvfp4_global_scale(w.abs().amax())
    codes, sb8 = nvfp4_quantize(w, g, axis=1)
    return codes, sb8, g


__all__ = ["FP4_LEVELS", "FP4_MAX", "FP8_MAX", "NVFP4_BLOCK", "fp4_decode", "fp4_encode", "fp8_cast",
           "fp8_dequantize", "fp8_fake_quant", "fp8_quantize", "fp8_round", "fp8_scale", "fp8_weight",
           "nvfp4_dequantize", "nvfp4_fake_quant", "nvfp4_global_scale", "nvfp4_quantize", "nvfp4_weight",
           "pack_fp4", "unpack_fp4"]
