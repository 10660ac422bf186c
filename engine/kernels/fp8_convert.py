"""E4M3 -> float conversion in registers for the W8A16 GEMVs: the ways the sweep compares (issue 14).

The weight is read as int32 words (4 E4M3 codes each, byte p = element 4j + p, little-endian) so each thread
issues 16-byte loads whatever Triton infers for an 8-bit tile, and each word becomes four float32 values:

- "bits": integer operations only. An E4M3 code s eeee mmm placed as the float16 bits s 0eeee mmm0000000 is the
  same number times 2^-8 (the exponent bias 7 read as 15): exact for every normal and subnormal code, since
  E4M3's subnormals (e = 0) land on float16 subnormals with the same mantissa. Two codes a 32-bit register
  (bytes 0 and 2, then 1 and 3), then float16 -> float32. The 2^8 is NOT applied here: the caller folds it
  into its per-row scale (`BITS_SCALE`), free in the epilogue. The NaN codes (0x7F, 0xFF) become 480 * 2^-8,
  not NaN: a checkpoint with NaN weights is broken anyway, and `fp8_linear_ref` would say so.
- "asm": the hardware's paired conversion `cvt.rn.f16x2.e4m3x2` (sm_89+) through inline PTX, then float16 ->
  float32; exact (NaN stays NaN). The CPU interpreter cannot run PTX: the launchers refuse it there.

`e4m3_bits_ref` is the plain-torch statement of the bit trick (tested over all 256 codes against torch's own
float8_e4m3fn conversion); the Triton kernels are tested against `fp8_linear_ref`.
"""
from __future__ import annotations

import torch
from stoker.engine.kernels._triton import tl, triton

# "cast": Triton's float8e4nv tensor .to() on an 8-bit tile (the default). "-join": the same word conversion,
# its four slices joined back into the weight tile so x is read contiguously (see fp8_linear._words_loop).
CONVERTS = ("cast", "bits", "asm", "bits-join", "asm-join")
CONVERT_CODE = {name: code for code, name in enumerate(CONVERTS)}  # the kernels' CONVERT constexpr
BITS_SCALE = 256.0  # "bits" yields value * 2^-8; the caller multiplies its float32 sums by this


def e4m3_bits_ref(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> float16 holding value * 2^-8, by the kernels' bit operations (exact; see above)."""
    c = codes.to(torch.int32)
    bits = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    return bits.to(torch.int16).view(torch.float16)


# cvt.rn.f16x2.e4m3x2 d, a: a's low byte -> d's low half. One int32 word in ($4), four float32 out ($0-$3).
# A constexpr: the GPU compiler reads no other module global inside a kernel.
_ASM_E4M3X4_TO_F32 = tl.constexpr("""
{
.reg .b16 e01, e23, h0, h1, h2, h3;
.reg .b32 p01, p23;
mov.b32 {e01, e23}, $4;
cvt.rn.f16x2.e4m3x2 p01, e01;
cvt.rn.f16x2.e4m3x2 p23, e23;
mov.b32 {h0, h1}, p01;
mov.b32 {h2, h3}, p23;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}
""")


@triton.jit
def _f16_bits_to_f32(bits):
    """uint32 whose low 16 bits are a float16 -> float32."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3x4_to_f32(words, CONVERT: tl.constexpr):
    """int32 words of 4 E4M3 codes -> (f0, f1, f2, f3) float32, f_p from byte p. CONVERT 1 ("bits") yields
    each value times 2^-8 (see BITS_SCALE); 2 ("asm") the values themselves."""
    if CONVERT == 1:
        u = words.to(tl.uint32, bitcast=True)
        # Sign stays the top bit of its half; exponent + mantissa shift to the float16 field (see the docstring).
        even = ((u & 0x007F007F) << 7) | ((u & 0x00800080) << 8)  # bytes 0 and 2 as two float16
        odd = ((u >> 1) & 0x3F803F80) | (u & 0x80008000)  # bytes 1 and 3
        f0 = _f16_bits_to_f32(even)
        f2 = _f16_bits_to_f32(even >> 16)
        f1 = _f16_bits_to_f32(odd)
        f3 = _f16_bits_to_f32(odd >> 16)
    else:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _ASM_E4M3X4_TO_F32, "=r,=r,=r,=r,r", [words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return f0, f1, f2, f3


@triton.jit
def e4m3_words_to_tile(words, CONVERT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 4] int32 words -> the [BLOCK_N, BLOCK_K] float32 weight tile in K order (times 2^-8
    for CONVERT 1, "bits"): join(join(f0, f2), join(f1, f3)) is [BN, BK/4, 2, 2] with [.., a, b] = f_(2a + b),
    so its row-major reshape is element 4j + p at column 4j + p."""
    f0, f1, f2, f3 = e4m3x4_to_f32(words, CONVERT)
    return tl.reshape(tl.join(tl.join(f0, f2), tl.join(f1, f3)), [BLOCK_N, BLOCK_K])
