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
- F16_VWORDS (3, decode kernel only, GPU only: inline PTX): as F16, but V is read as int32 words and converted
  with `cvt.rn.f16x2.e4m3x2` before it reaches shared memory. Why: compiled for sm_90, F16's V tile (the dot's
  second operand with head_dim, not keys, contiguous) stays 8-bit in shared memory and is read back a byte at a
  time (64 ld.shared.b8 per thread and tile), since Triton sinks the conversion past the shared-memory trip;
  words joined into an fp16 tile cannot be sunk, and a 16-bit tile is read transposed with ldmatrix. The
  interpreter cannot run PTX: tests check it on the GPU, and its sm_90 compile on the CPU.
- MMA (4, decode only): not a Triton mode but another kernel, decode_fp8_mma.py (Gluon: K and V loaded straight
  into tensor-core operand registers, no shared memory; one warp a program whatever num_warps says, num_stages
  unused). Where that kernel cannot run (the interpreter, the CPU, shapes it does not take) the split kernel runs
  F16_VWORDS at tile 64 (the prefill kernel F16). attention.DECODE_FP8_MMA makes it the default for launches of
  one split.
"""
from __future__ import annotations

from dataclasses import dataclass

from stoker.engine.kernels._triton import tl, triton

FP8_CAST, FP8_F16, FP8_BITS, FP8_F16_VWORDS, FP8_MMA = 0, 1, 2, 3, 4
FP8_MODES = {"cast": FP8_CAST, "f16": FP8_F16, "bits": FP8_BITS, "f16-vwords": FP8_F16_VWORDS, "mma": FP8_MMA}
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


# Measured on the H200 (2026-12-01 15:28 UTC, ops/bench_decode_attention_fp8.py, CUDA-graph replay, 8B heads):
# decode at B=1,024 ctx 640: bf16 cache 628 us; FP8 cast n64 661, f16 n64 581, f16-vwords n64 555, f16-vwords
# n128 w4 **469** (2.86 TB/s of FP8 bytes; the fastest at every B >= 256 and ctx 640 / 4,096), n128 w8 669,
# bits 753. At B=1 all are 6-7 us (bf16 5.9). Prefill (8,192 tokens): bf16 189 us, cast 248, f16 n64 212, n32
# 208, bits 272: F16 stays there (compute-bound; the conversion still costs ~12 %).
# Before that run: picked (ops/bench_decode_attention_fp8.py times all; its --ptx table, sm_90,
# TILE_N 64, 4 warps): F16_VWORDS is the only FP8 decode variant without the 64 byte-wide shared-memory loads
# and the 128 fp16 -> bf16 conversions a thread and tile (whole-kernel PTX: 957 lines vs 918 for the bf16
# cache, 1,145 CAST, 1,194 F16). The prefill kernel reads no V byte-wise (its M is 64), so F16 there.
# Tried and removed (H200, 21:09 UTC, B=1,024 ctx 640, us; default 465.9): the grid with the kv head fastest,
# so one sequence's Hkv programs read each cache row together, 465.9; the V words loaded a tile ahead, 636.8
# (206 registers a thread against 144 by ptxas: 2 programs an SM, not 3); two splits 727.9; s4 466.1. n64 has
# the bf16 kernel's occupancy (112 registers, 39 KB) and half its bytes yet 555 us against 629: what is left
# costs per key tile, not per byte (BENCHMARKS.md, 21:09 section). Session 20 (ncu): that kernel waited for every
# copy at the top of each tile (attention.DECODE_TABLE_AHEAD says why); with the copies multi-buffered n64 w4 s3
# is the fastest, 464.3 us (n128 ahead 519.5: 106 KB of shared memory, 2 blocks an SM).
DEFAULT_DECODE = Fp8AttentionConfig("f16-vwords", tile_n=64)
DEFAULT_PREFILL = Fp8AttentionConfig("f16")


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
def _byte_f16(packed, SHIFT: tl.constexpr):
    """The e4m3 byte at bit SHIFT of each int32 word, as float16 (Triton's cast: the interpreter's path)."""
    return ((packed >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def v_words_f16(v_cache_ptr, slot, kv_head, key_mask, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_PTX: tl.constexpr):
    """The V tile [keys, BLOCK_D] of an FP8 cache as float16 (F16_VWORDS): 4 bytes a word (head_dim % 4 == 0),
    each word -> 4 halves by two paired conversions, joined back in head_dim order (byte i = dim 4w + i).
    USE_PTX False (the interpreter) converts each byte with Triton's cast instead: the same words, masks and
    join, so the CPU tests check all of it but the two conversion instructions."""
    words = tl.arange(0, BLOCK_D // 4)
    row = slot * (NUM_KV_HEADS * HEAD_DIM // 4) + kv_head * (HEAD_DIM // 4)
    packed = tl.load(v_cache_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] + words[None, :],
                     mask=key_mask[:, None] & (words[None, :] < HEAD_DIM // 4), other=0)
    if USE_PTX:
        h0, h1, h2, h3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 p01, p23; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 p01, lo; "
            "cvt.rn.f16x2.e4m3x2 p23, hi; mov.b32 {$0, $1}, p01; mov.b32 {$2, $3}, p23; }",
            "=h,=h,=h,=h,r", [packed], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        h0 = _byte_f16(packed, 0)
        h1 = _byte_f16(packed, 8)
        h2 = _byte_f16(packed, 16)
        h3 = _byte_f16(packed, 24)
    # join's new axis is the last: [w, j, i] holds (h0, h2)[j] for i = 0 and (h1, h3)[j] for i = 1, so the
    # flattened order is h0 h1 h2 h3 (join(join(h0, h1), join(h2, h3)) would give h0 h2 h1 h3; the CPU test saw it)
    return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (slot.shape[0], BLOCK_D))


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
