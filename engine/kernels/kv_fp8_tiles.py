"""How the attention kernels turn FP8 KV cache tiles into dot operands (the FP8_CACHE branches of attention.py).

Why this exists: with the FP8 cache, W2's decode attention reads half the bytes of the bf16 cache and was no
faster (H200, 2026-12-01: W2 decode 9.50 s vs 9.25 s). Compiled for sm_90 (triton 3.6, TILE_N 64, 4 warps), the
old path's K/V conversion is one paired `cvt.rn.f16x2.e4m3x2` per 2 elements and then one `cvt.bf16.f16` per
element (fp8 -> bf16 goes through fp16 there), plus byte-wide shared-memory reads of the transposed K tile:
about 200 extra instructions per thread and tile, enough to make the kernel issue-bound instead of
bandwidth-bound. The modes (a constexpr, so the interpreter only meets what it can run):

- CAST (0): tiles converted to q's dtype (the old path; bf16 costs the two-step conversion above).
- F16 (1): the dots run in float16 whatever the model dtype: e4m3 -> fp16 is the one paired instruction and
  exact (e4m3 fits fp16); q is cast to fp16 (clamped to fp16's range: only a |q| past 65,504 changes, where
  bf16 scores would be meaningless anyway; bf16 -> fp16 is otherwise exact down to 2^-14, below which fp16
  keeps fewer bits than bf16, a relative change of the scores under 1e-3 of |q| max in practice); the
  probabilities (in [0, 1]) lose nothing in fp16 that bf16 keeps. Float32 models keep float32 dots.
- BITS (2): as F16, with the conversion done by integer ops: the byte s.eeee.mmm placed at fp16's bits
  s.0eeee.mmm0000000 is the same number times 2^-8, normals and subnormals alike (fp16's exponent bias is 8
  more than e4m3's, and an e4m3 subnormal lands on the fp16 subnormal of the same mantissa), so the kernels
  fold 2^8 into the scales. The one difference: e4m3fn's NaN codes (0x7F, 0xFF) read as +-480 rather than
  NaN. The cache write never stores NaN from finite input (it saturates at +-448), so only a NaN already in
  the model's k/v is lost, which the other modes would propagate.
"""
from __future__ import annotations

from dataclasses import dataclass

from stoker.engine.kernels._triton import tl, triton

FP8_CAST, FP8_F16, FP8_BITS = 0, 1, 2
FP8_MODES = {"cast": FP8_CAST, "f16": FP8_F16, "bits": FP8_BITS}
BITS_UNIT = 256.0  # BITS mode reads e4m3 value v as the fp16 v * 2^-8; the kernels multiply 2^8 back in float32
FP16_MAX = 65504.0


@dataclass(frozen=True, slots=True)
class Fp8AttentionConfig:
    """The FP8 cache's launch choices for one attention kernel (the bf16 cache keeps its own)."""

    mode: str = "f16"
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.mode not in FP8_MODES:
            raise ValueError(f"FP8 attention mode must be one of {sorted(FP8_MODES)}, got {self.mode!r}")
        if self.tile_n < 16 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"FP8 attention tile_n must be a power of two >= 16, got {self.tile_n}")

    def label(self) -> str:
        return f"{self.mode} n{self.tile_n} w{self.num_warps} s{self.num_stages}"


# Picked before the H200 measured them (see BENCHMARKS.md once it has): F16 removes the per-element second
# conversion at no precision cost and keeps Triton's own (hardware) conversion; the bench compares all.
DEFAULT_DECODE = Fp8AttentionConfig()
DEFAULT_PREFILL = Fp8AttentionConfig()


def fp8_dot_fp16(mode: str, q_is_fp32: bool) -> bool:
    """Whether the FP8 cache's dots run in fp16 (F16 and BITS on 16-bit models; float32 models stay fp32)."""
    return FP8_MODES[mode] != FP8_CAST and not q_is_fp32


@triton.jit
def e4m3_bits_to_f16(byte):
    """uint8 e4m3fn codes -> float16 holding value * 2^-8 (exact; NaN codes give +-480 * 2^-8)."""
    bits = byte.to(tl.uint16)
    half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True)


@triton.jit
def kv_for_dots(tile, dot_dtype: tl.constexpr, MODE: tl.constexpr):
    """A K or V tile as loaded from the cache -> dot_dtype. A cache in the model's dtype has MODE CAST and this
    is the kernels' old `.to(q.dtype)`, a no-op."""
    if MODE == 2:
        tile = e4m3_bits_to_f16(tile.to(tl.uint8, bitcast=True)).to(dot_dtype)
    else:
        tile = tile.to(dot_dtype)
    return tile


@triton.jit
def fp8_unit(MODE: tl.constexpr):
    """What the kernel multiplies back into k_scale and v_scale: 2^8 in BITS mode, else 1."""
    return 256.0 if MODE == 2 else 1.0


@triton.jit
def q_for_dots(q, DOT_FP16: tl.constexpr):
    """q in the FP8 cache's dot dtype: clamped into fp16's range when the dots run in fp16."""
    if DOT_FP16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q
