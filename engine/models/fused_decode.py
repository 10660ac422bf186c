"""The fused small-M decode path of a Llama-family decoder layer (issue 13): a decode step of M <= GEMV_MAX_M
tokens runs, per layer,

    RMSNorm -> qkv GEMV + rotary + KV-cache write -> decode attention -> o_proj GEMV + residual add
            -> RMSNorm -> gate_up GEMV + SiLU-and-mul -> down GEMV + residual add

(engine/kernels/gemv.py's kernels: 8 launches where the unfused path has 12: no rotary, SiLU or split-K reduce
kernels). The residual add sits in the o_proj and down epilogues, so the layer's output is already the new
residual stream: it returns (stream, None) and the next RMSNorm has nothing to add. With "fused-folded" the
RMSNorm weight lives in qkv_proj / gate_up_proj and both norms run in the GEMV prologues (6 launches) at steps of up
to EngineConfig.decode_prologue_norm_max_m tokens (larger ones run the norm kernel on unit gains first): what "auto" picks
(resolve_decode_kernels says why). With EngineConfig.decode_fused_mlp gate_up, SiLU-mul, down and the residual
add are engine/kernels/fused_mlp.py's two launches instead of two GEMVs (at every M <= 16): the fused-folded layer
is qkv, attention, o_proj, the MLP's streaming kernel and its small finishing kernel.

Weights: the kernels read the nn.Linear layout [N, K] as it is (16-byte loads along K; gemv.py says why no
re-layout pays), so the fused path multiplies the very parameters the unfused one does: no second copy. Folding
rewrites qkv / gate_up in place (W' = W diag(g), a chunk of rows at a time so the float32 temporary stays
small) and sets the norm weight to ones: the unfused path (prefill, batches > 16) then computes the same
function from the same tensors.

Which layers take it (`bind_fused_decode`'s reasons; the answer is the same for every layer of a model):
- Qwen2's q/k/v bias: added in the qkv epilogue. Qwen3's per-head q/k RMSNorm: in the qkv epilogue too (one
  program per head, so a little slower at batch 1 than without it).
- bf16 "fused-folded" with the fused MLP carries its norms (FOLDED_NORM_CARRY): o_proj's epilogue adds each token's
  sum(s^2) for the MLP, the MLP's finishing kernel for the next layer's qkv, and those scale by 1 / rms (g is in their
  weights), so only the first layer's input norm is a prologue / kernel: 5 launches a layer. MLP_FINISH_IN_QKV (on at
  one token) makes it 4 but in the last layer: the finishing kernel's work done by the next layer's qkv.
- bf16 at one token: qkv, the attention and o_proj launch with PDL (QKV_PDL, O_PROJ_PDL) where o_proj's launch loads
  several K tiles before its wait, the rest of the chain without (MLP_PDL, FINISH_EARLY: measured slower).
- FP8 linears with row scales (per-channel, per-tensor, `--quantization fp8`) run the same kernels as W8A16
  (gemv.py's weight_scale: E4M3 converted in registers, the row scale on the float32 sums before each
  epilogue); never folded (W diag(g) would need requantizing), so both modes carry the norms across their GEMVs
  (NORM_CARRY, NormCarry: the residual-add epilogue stores s * g and each token's sum(s^2), the next GEMV scales
  by 1 / rms; W1 FP8 8B 2.49 -> 2.35 ms, session 18); without NORM_CARRY they run the RMSNorm kernels (with
  FP8_PROLOGUE_NORM, "fused-folded" runs them in the qkv / gate_up prologues with g applied to x in the K loop
  instead: slower since session 17). Launch shapes and conversions: FP8_FUSED_M1 per 8B shape at one token,
  FP8_FUSED_DOT at 2-16 (fp8_launch); other one-token shapes take fp8_linear.FP8_GEMV_CONFIGS for o_proj / down
  and the bf16 sweep's configs for the SiLU / rotary kernels. They launch with programmatic dependent launch
  unless EngineConfig.decode_pdl says otherwise, the norm kernels included (FP8 W1 at 8B 2.72 vs 2.81 ms in session
  15; with the PDL norm kernels and the early tiles of FP8_FUSED_M1 2.49-2.51 in session 17). Block-scaled FP8
  (128 x 128) keeps the unfused path, as do tensor-parallel linears (F.linear and their all-reduce: a residual
  add cannot precede the row-parallel sum).
- The FP8 KV cache (float8_e4m3fn) is written by the qkv epilogue as the unfused rotary does it: k / k_scale and
  v / v_scale (the attention module's per-tensor scales, kv_quant.py), rounded to nearest even and saturated at
  +-448, Qwen2's bias and Qwen3's q/k norm included (both come before the rotation, so before the quantization).
- The LM head (tied or not) stays on F.linear in every mode: its float32 logits are issue 13 item 2's, and a
  tied head is the embedding, so the final norm is never folded into it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
from stoker.engine.batch import AttentionMetadata
from stoker.engine.config import EngineConfig
from stoker.engine.kernels import gemv
from stoker.engine.kernels._triton import HAS_TRITON
from stoker.engine.kernels.fp8_linear import fp8_gemv_config
from stoker.engine.kernels.fused_mlp import MLP_MAX_M, fused_mlp_triton
from stoker.engine.kernels.gemv import (
    GEMV_MAX_M,
    GemvConfig,
    NormCarryOut,
    fold_norm_weight,
    gemv_rotary_cache_triton,
    gemv_triton,
    norm_sums_buffer,
)
from stoker.engine.kernels.kv_quant import FP8_KV_DTYPE, is_fp8_cache
from stoker.engine.layers import (
    ColumnParallelGateUp,
    ColumnParallelQKV,
    Fp8GateUpLinear,
    Fp8Linear,
    Fp8QKVLinear,
    GateUpLinear,
    Linear,
    PagedAttention,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from stoker.engine.parallel.plan import ShardPlan
from torch import nn

_FOLD_ROWS = 1024  # rows folded per chunk: a 16 MB float32 temporary at hidden 4096
# How each fused GEMV turns FP8 weights into floats (gemv.py's weight_convert: "cast", "bits-join", "asm-join"),
# per kernel: "rope" (qkv), "silu" (gate_up), "add" (o_proj, down). From ops/bench_fp8_fused.py on the H200
# (2026-12-01 14:45 UTC, 8B shapes, M = 1, us per call, launch shapes as below): gate_up + SiLU on the tl.dot
# config 16x32x128 w2 s5: cast 48.1, bits-join 42.9, asm-join 33.0 (84 % of copy bandwidth); o + add on the
# FP8 table's CUDA-core 1x8x1024: cast 8.8, asm-join 13.2; down + add: cast 23.4, asm-join 39.1; qkv + rope
# (CUDA cores 1x4x512): cast 13.2, asm-join 13.6. Off the GPU "asm-join" becomes "cast" (no PTX there).
FP8_WEIGHT_CONVERT: dict[str, str] = {"rope": "cast", "silu": "asm-join", "add": "cast"}
# FP8 under "fused-folded" with this set: the two RMSNorms run in the qkv / gate_up prologues with g unfolded (x * g
# in the K loop and an rms pass over x in every program), 4 launches a layer instead of 6. Off: the norm kernels,
# launched with PDL in the FP8 chain (each lets the next GEMV in before it normalises). Measured on the H200
# (2026-12-03, session 17, W1 FP8 8B, ops/bench.py "+pro0" against the prologues, same machine): 2.628 -> 2.510 ms;
# the critical path per layer (ops/kernel_path.py) had gate_up 35.1 -> 30.0 us and qkv 11.7 -> 7.3 us against
# 2 x 2.0 us of norm kernels. So off.
FP8_PROLOGUE_NORM = False
# One token on the GPU: (kernel, weight rows, K) -> (launch shape, conversion), the fastest of ops/bench_fp8_fused.py
# --row-grid --pick with gemv.ROW_SUM_FP8's in-register run sums (H200, 2026-12-03 06:35 UTC, 8B shapes, us per
# call in CUDA-graph chains; the table before it in brackets, same run); shapes it does not list take
# FP8_WEIGHT_CONVERT and the launchers' own configs. W1 FP8 (ops/bench.py --dtype fp8; BENCHMARKS.md, 2026-12-03):
# 2.65 and 2.67 ms with this table and the run sums (two machines), 2.72 with the table before without them, 2.88 /
# 2.93 with the table before and the run sums, 2.83 with this table without them; 2.78 on a third machine with down
# at 1x4x1024.
# pdl_tiles (session 17, W1 FP8 under PDL, same machine): o_proj with all four K tiles loaded before its wait, i.e.
# while the decode attention runs, 2.658 -> 2.631 ms (its charge on the critical path 5.8 -> 4.1 us a layer, the
# attention's 5.5 -> 6.7: o's stream now shares the bus with it); gate_up with two, 2.510-2.521 -> 2.488-2.494 with
# the norm kernels (four: 2.512); qkv with two or four lost (2.506 -> 2.531 / 2.556): it follows a norm kernel of 2 us.
# down at 1x4x1024 again: 2.753 against 2.658 ms with this entry (settles session 16's open 2.65 / 2.78 question).
FP8_FUSED_M1: dict[tuple[str, int, int], tuple[GemvConfig, str]] = {
    ("rope", 6144, 4096): (GemvConfig(1, 2, 1024, False, 4, 3), "cast"),  # qkv: 8.7 (1x2x512 w2 asm-join 9.3)
    ("add", 4096, 4096): (GemvConfig(1, 4, 1024, False, 4, 3, pdl_tiles=4), "asm-join"),  # o: 6.7 (cast 6.8)
    # down: 16.2 with 16 codes a thread (1x4x1024: 16.4; the table's before, without the sums: 16.7)
    ("add", 4096, 14336): (GemvConfig(1, 4, 2048, False, 4, 3), "cast"),
    # gate_up: 30.8 (dot 16x32x128 asm-join 32.7)
    ("silu", 28672, 4096): (GemvConfig(1, 4, 1024, False, 4, 3, pdl_tiles=2), "cast"),
}
# 2-16 tokens on the GPU: the 16-row tl.dot tile, whose cost does not depend on how many of its rows are live, so
# the one-token figures of the same tile stand for these (H200 15:50 UTC, 8B, us): o + add 16x16x256 w2 s4
# asm-join 9.6 (the W8A16 table's 16x32x512 cast: 11.8 at M = 2-16, 11:30 UTC), down + add 25.9 (33.8), qkv +
# rope 16x32x128 w2 s5 asm-join 17.3 (the casts on dot tiles: 32.0-32.4), gate_up + SiLU 16x32x128 w2 s5
# asm-join 32.7.
FP8_FUSED_DOT: dict[str, tuple[GemvConfig, str]] = {
    "add": (GemvConfig(16, 16, 256, True, 2, 4), "asm-join"),
    "rope": (GemvConfig(16, 32, 128, True, 2, 5), "asm-join"),
    "silu": (GemvConfig(16, 32, 128, True, 2, 5), "asm-join"),
}

# PDL on the attention -> o_proj boundary alone where the layer's chain runs without it (bf16), for an o_proj launch
# that loads several K tiles before its wait (GemvConfig.pdl_tiles > 1: gemv._TUNED_M1's 8B entry): the attention,
# latency-bound and on few SMs, lets o_proj's programs in once qkv is done, and they stream their tiles while it
# runs. H200, W1 bf16 8B (session 17, three machines, same-call A/Bs): 4.186 -> 4.151, 4.154 -> 4.106, 4.192 ->
# 4.141 ms; with the tensor-core o config (one small tile early) it lost (4.138 -> 4.253).
O_PROJ_PDL = True
# Under PDL the qkv GEMV lets the decode attention in before its own wait (gemv_rotary_cache_triton's
# pdl_trigger_first says why that is sound), so the attention's older keys load while qkv streams. Off until
# measured (ops/bench.py "+qkvfirst").
QKV_TRIGGER_FIRST = False
# bf16 at one token where the attention -> o_proj boundary runs with PDL (O_PROJ_PDL): the qkv GEMV launched with PDL
# too, so the decode attention after it becomes resident once qkv's programs are past their wait and loads its
# first key tile while qkv streams (without it the attention starts only when qkv has finished: 9.4 us a layer on
# the critical path against 7.4 in the FP8 chain, session 18's profiles). H200, W1 bf16 8B (session 18 call 6, one
# machine, interleaved): 4.041 / 4.045 against 4.111 / 4.103 ms.
QKV_PDL = True
# The decode attention on an FP8 KV cache launched with PDL where its chain has it (its early first tile converted
# as the loop converts, decode_pdl.py). H200, W1 FP8 weights + FP8 KV 8B (session 23, one machine, interleaved):
# 2.410 / 2.409 ms against 2.494 / 2.463 launched plainly (the bf16 cache: 2.35). The A/B: ops/bench.py
# "+set=fused_decode.FP8_CACHE_ATTENTION_PDL=False".
FP8_CACHE_ATTENTION_PDL = True
# FP8 layers (the ones that run RMSNorm kernels between their GEMVs): every norm but the first layer's input norm and
# the model's final norm done by the GEMVs around it instead (NormCarry), so the norm kernels and their boundaries
# leave the chain. Read when the model plans its decode (link_norm_carry). H200, W1 FP8 8B (session 18, ops/bench.py
# "+nocarry", same machine): 2.353 / 2.354 against 2.491 / 2.489 ms; 8 sequences 5.06-5.12 against 5.23 ms. On the
# critical path a layer: two norm kernels of 2.0 us gone, gate_up 30.0 -> 27.8 us, qkv 7.3 -> 7.1, while o_proj and
# down, which now also store s * g and add the sums, went 3.5 -> 6.1 and 14.5 -> 15.3 us.
NORM_CARRY = True
# bf16 "fused-folded" layers with the fused MLP at every fused step: the same carried norms with g folded into qkv /
# gate_up, so only each token's sum(s^2) travels (o_proj's epilogue adds it for the MLP, the MLP's finishing kernel for
# the next layer's qkv, which read the stream itself): no rms pass over x in the qkv / MLP prologues, and no norm
# kernels at 3-16 tokens (decode_prologue_norm_max_m); only the first layer's input norm and the final norm stay.
FOLDED_NORM_CARRY = True
# H200, W1 bf16 8B (session 19 call 1, one machine): 4.069 ms carried against 4.086 without (at 8 sequences, with
# MLP_PDL on: 4.981 against 5.095); the critical path a layer: qkv 15.8 -> 13.3 us (session 18's profile, no rms pass).
FOLDED_NORM_CARRY = True
# The fused MLP's streaming kernel launched with programmatic dependent launch wherever its layer's chain may take PDL
# (not under decode_pdl False): it waits first thing, so only its launch and setup overlap o_proj's end. Off: W1 bf16
# 4.112-4.126 against 4.061 ms (session 19 call 2, one machine); loading its first [128, 128] gate / up slices before
# the wait as well (in registers, where the pipeline keeps them in shared memory) was worse: 4.147-4.162 against
# 4.069 (call 1; the MLP 84.6 -> 88.3 us a layer), and gave wrong float32 results on the GPU (removed).
MLP_PDL = False
# The fused MLP's finishing kernel launched with PDL and let in as the streaming kernel starts; it lets the next
# layer's qkv (launched with PDL at one token, QKV_PDL) in before its own wait, so qkv is resident and has its first
# weight tile when the MLP ends instead of launching after the finishing kernel (qkv started 0.0 us early in session 19
# call 2's profile). Not under decode_pdl False. Off: W1 bf16 4.172 / 4.173 against 4.063 / 4.064 ms (session 19 call
# 3, one machine): qkv's CTAs, resident 80 us early, took 16.9 us on the critical path against 14.7 and the MLP 84.8
# against 83.4.
FINISH_EARLY = False
# Tried: the MLP as one launch, its last program finishing through an arrival counter (session 19's MLP_FINISH_IN):
# W1 4.082 against 4.030 ms on the H200 and wrong on the GPU in fp16 (session 20); removed.
# The fused MLP's finishing kernel folded into the next layer's qkv GEMV, in the bf16 chain with the folded carried
# norms (FOLDED_NORM_CARRY), every layer but the last: a layer launches the MLP's streaming kernel alone and hands on
# its float32 accumulator and the stream it would have added (o_proj's output) as (hidden, residual), the form an
# unfused layer hands on (MLP output, residual); the next layer's qkv rounds the accumulator to the model dtype, adds
# the stream and rounds again in its K loop (the finishing kernel's rounding: gemv's x_accumulator), sums the rms of
# those values there (every program reads all of K, so no carried sums for this qkv) and program 0 stores them, the
# new stream, for o_proj's residual add; that o_proj zeroes the accumulator (NormCarry says why it may then). One
# launch a layer fewer: the finishing kernel's 2.1 us on the H200's critical path (session 21's profile, W1 bf16 8B
# 4.09 ms), against every qkv program reading the float32 accumulator and the stream (6 bytes an element from L2
# where it read the stream's 2) and rounding, adding and squaring them in its K loop.
# H200, W1 bf16 8B (session 24, one machine, interleaved: ops/bench.py --skip-w2 --max-num-seqs 1 --decode-kernels
# auto,auto+set=fused_decode.MLP_FINISH_IN_QKV=True x2): 4.002 / 4.017 ms on against 4.069 / 4.067 off. So on, at one
# token (the cap below). Read when the model plans its decode (link_norm_carry), as is the cap.
MLP_FINISH_IN_QKV = True
# With it on, steps of up to this many tokens take it (M is fixed per CUDA-graph bucket, so a bucket takes one form or
# the other): x processed inside the loop is what made the tl.dot path slow before (gemv.py: the in-loop norm took
# the 8B qkv 15 -> 35-57 us at M = 8), and on sm_90 this qkv's dot tile asks 57,344 bytes of shared memory a block
# against the carried form's 8,192 (one token: 128 either way; tests/test_kernels_compile_sm90.py). Only one token
# was measured (session 24), so 2-16 keep the finishing kernel until an A/B at those sizes says otherwise
# ("+set=fused_decode.MLP_FINISH_IN_QKV_MAX_M=16").
MLP_FINISH_IN_QKV_MAX_M = 1


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """A decoder layer's fused decode: how, and the layer's own modules it reads (no weight is copied)."""

    folded: bool  # the RMSNorm weights are folded into qkv / gate_up (the norms run in their prologues)
    mlp_max_m: int  # steps of up to this many tokens run the MLP as kernels/fused_mlp.py's two launches (0: never)
    mlp_accumulator: torch.Tensor | None  # the fused MLP's zeroed float32 [mlp_max_m * H] (left zero by each launch)
    # Steps of up to this many tokens run the norms in the qkv / gate_up prologues (folded, or under FP8 with g
    # applied to x there); larger steps, and every step of "fused" (0), run the norm kernel first.
    prologue_max_m: int
    pdl: bool  # launch the GEMVs with programmatic dependent launch
    input_norm: RMSNorm
    qkv: QKVLinear | Fp8QKVLinear
    q_norm: RMSNorm | None  # Qwen3's per-head q / k norms
    k_norm: RMSNorm | None
    rotary: RotaryEmbedding
    attention: PagedAttention
    o_proj: Linear | Fp8Linear
    post_norm: RMSNorm
    gate_up: GateUpLinear | Fp8GateUpLinear
    down: Linear | Fp8Linear
    pdl_off: bool = False  # EngineConfig.decode_pdl False: no PDL anywhere, O_PROJ_PDL's boundary included
    carry: NormCarry | None = None  # the model's carried-norm buffers (link_norm_carry), None: the norm kernels
    carry_in: bool = False  # the previous layer's down wrote this layer's normalised input's half (not layer 0)
    next_norm: RMSNorm | None = None  # the next layer's input norm, for down's carry (None: the last layer)
    # Tensor parallel (bf16 twins): this rank's shard of o_proj / down (row-parallel). Their GEMVs give this rank's
    # partial sums, rank 0's with the residual added in the epilogue, and the shard's all-reduce sums them into the
    # stream (one collective after o_proj and one after the MLP, as the unfused twins). None: one GPU.
    shard: ShardPlan | None = None
    # MLP_FINISH_IN_QKV: steps of up to this many tokens launch the MLP's streaming kernel alone and leave the rest to
    # the next layer's qkv (0: never; the last layer, whose stream the model's final norm reads, finishes its own).
    mlp_pending_max_m: int = 0


@dataclass(frozen=True, slots=True)
class NormCarry:
    """The carried norms' buffers, one set per model, shared by its fused layers (NORM_CARRY). An RMSNorm between two
    GEMVs is split over them: the producer's epilogue (o_proj's or down's residual add) stores x = s * g and adds
    each token's sum(s^2) into NORM_SLOTS int64 slots (fixed point), and the consumer (gate_up, the next layer's qkv) reads x and
    the slots and scales its float32 sums by 1 / rms (gemv_carried_ref). post_*: the post-attention norm (o_proj ->
    gate_up); next_*: the next layer's input norm (down -> qkv).

    The slots must be zero when a producer adds into them, and nothing zeroes them between kernels but the kernels
    themselves: o_proj zeroes sums_next (read by this layer's qkv, which finished before the attention o_proj waits
    on), down zeroes sums_post (read by gate_up, its predecessor); down adds into sums_next only after its wait (by
    then o_proj's zeroing is done), o_proj into sums_post after the previous layer's down (which zeroed them) is
    done. Every kernel of the chain waits for its predecessor before it stores (PDL or not), so each of these
    orders holds, and both buffers are zero again after every step (the last layer adds into neither). The first
    layer's qkv zeroes sums_post as well, so a step starts clean even after one that stopped halfway. Each buffer
    holds GEMV_MAX_M tokens; a step uses its first M rows.

    MLP_FINISH_IN_QKV (the folded form; every layer's MLP but the last left unfinished): no finishing kernel adds
    into sums_next (the next qkv sums its rms in its own K loop, and the last layer's finishing kernel has no next
    norm), and o_proj still zeroes it. sums_post, read by the unfinished MLP, is zeroed by the next layer's qkv: that
    qkv is launched after the MLP and, with PDL or without, stores only once the MLP has completed (its wait; a plain
    launch starts after it), and that layer's o_proj adds into it only after its own wait. The MLP's float32
    accumulator (one a layer), read by the next layer's qkv after its wait, is zeroed by that layer's o_proj after
    its wait: o_proj waits for the attention, whose programs (every split-0 program at least) wait for qkv before
    they read q, so the attention completes only after qkv has, and o_proj's stores follow every qkv program's
    reads; the next add into that accumulator is the same layer's MLP a step later. So every slot and accumulator
    is zero after a step (the last layer's finishing kernel zeroes its own accumulator and sums_post), as without
    it; a step stopped between an MLP and the next layer's o_proj would leave its accumulator dirty, as a step
    stopped between the two MLP kernels does without it."""

    x_post: torch.Tensor | None  # [GEMV_MAX_M, H] model dtype; None where g is folded (the consumer reads s)
    sums_post: torch.Tensor  # gemv.norm_sums_buffer(GEMV_MAX_M): zero between steps
    x_next: torch.Tensor | None
    sums_next: torch.Tensor

    @classmethod
    def allocate(cls, hidden: int, dtype: torch.dtype, device: torch.device, *, folded: bool = False) -> NormCarry:
        """folded: the norms' g live in the consumers' weights (FOLDED_NORM_CARRY), so only the sums are carried: the
        fused MLP's finishing kernel adds the next layer's (no x_next) and o_proj the MLP's (no x_post)."""
        def x() -> torch.Tensor | None:
            return None if folded else torch.empty(GEMV_MAX_M, hidden, dtype=dtype, device=device)

        return cls(x(), norm_sums_buffer(GEMV_MAX_M, device), x(), norm_sums_buffer(GEMV_MAX_M, device))


def link_norm_carry(fused: list[FusedDecode | None]) -> list[FusedDecode | None]:
    """The layers' FusedDecode with the carried norms linked where every layer is fused and either (NORM_CARRY)
    normalises with norm kernels (no prologue norm) on FP8 weights, or (FOLDED_NORM_CARRY) has g folded into its
    weights and the fused MLP at every fused step; otherwise as given."""
    if not fused or any(fd is None or fd.shard is not None for fd in fused):
        return fused  # tensor parallel: a rank's epilogue sees a partial sum, not the stream whose norm it would carry
    layers = cast(list[FusedDecode], fused)
    fp8 = NORM_CARRY and all(not fd.prologue_max_m and isinstance(fd.o_proj, Fp8Linear) for fd in layers)
    folded = FOLDED_NORM_CARRY and all(fd.folded and fd.mlp_max_m >= GEMV_MAX_M for fd in layers)
    if not (fp8 or folded):
        return fused
    weight = layers[0].input_norm.weight
    carry = NormCarry.allocate(weight.shape[0], weight.dtype, weight.device, folded=not fp8)
    pending_max_m = MLP_FINISH_IN_QKV_MAX_M if MLP_FINISH_IN_QKV and not fp8 else 0  # the folded chain only
    return [dataclasses.replace(fd, carry=carry, carry_in=i > 0,
                                next_norm=layers[i + 1].input_norm if i + 1 < len(layers) else None,
                                mlp_pending_max_m=pending_max_m if i + 1 < len(layers) else 0)
            for i, fd in enumerate(layers)]


_PLAIN_KINDS = (QKVLinear, Linear, GateUpLinear, Linear)
_TP_KINDS = (ColumnParallelQKV, RowParallelLinear, ColumnParallelGateUp, RowParallelLinear)
_FP8_KINDS = (Fp8QKVLinear, Fp8Linear, Fp8GateUpLinear, Fp8Linear)


def resolve_decode_kernels(config: EngineConfig) -> str:
    """"auto" -> "fused-folded" on CUDA with Triton, else "cublas"; other values as they are.

    Why folded: on the H200 (bf16, W1, 2026-12-01 14:44 UTC) it was already faster at the 1B shape (0.994 vs
    1.039 ms a token) and its kernels got their own M = 1 configs since (gemv._TUNED_M1: the 8B folded qkv 21.2
    -> 16.1 us, gate_up 60.3 -> 58.0, against 14.8 + 56.4 us unfolded plus two RMSNorm launches of ~2.8 us
    each with their gaps), which puts it ahead at 8B too by that arithmetic; the next W1 run measures it."""
    if config.decode_kernels != "auto":
        return config.decode_kernels
    on_cuda = config.device is not None and config.device.startswith("cuda")
    return "fused-folded" if on_cuda and config.use_triton and HAS_TRITON else "cublas"


def bind_fused_decode(
    mode: str, pdl: bool | None, kv_dtype: torch.dtype, *, fused_mlp: bool, prologue_max_m: int, input_norm: RMSNorm,
    qkv: nn.Module,
    q_norm: RMSNorm | None, k_norm: RMSNorm | None, rotary: RotaryEmbedding, attention: PagedAttention, o_proj: nn.Module,
    post_norm: RMSNorm, gate_up: nn.Module, down: nn.Module,
) -> FusedDecode | str:
    """A layer's FusedDecode for `mode` ("fused" or "fused-folded"; called once the weights are in, and
    folding them for fused-folded), or why the layer must keep the unfused decode path. fused_mlp: the fused steps
    of 16-bit (or float32) weights run the MLP through kernels/fused_mlp.py (EngineConfig.decode_fused_mlp).
    prologue_max_m: the largest step that normalises in the prologues (EngineConfig.decode_prologue_norm_max_m).
    pdl None: PDL for FP8 weights only (EngineConfig.decode_pdl)."""
    # Exact types: the tensor-parallel twins are subclasses of the plain linears.
    kinds = (type(qkv), type(o_proj), type(gate_up), type(down))
    fp8 = kinds == _FP8_KINDS
    tp = kinds == _TP_KINDS
    setting, pdl = pdl, fp8 if pdl is None else pdl
    if kinds != _PLAIN_KINDS and not fp8 and not tp:
        # The FP8 tensor-parallel twins: their fused form (row scales, the carried norms' FP8 chain without a carry)
        # is not built; they run the FP8 GEMVs / _scaled_mm and the all-reduce unfused.
        return ("FP8 tensor-parallel (or partly FP8) linears keep their own GEMV / all-reduce path: "
                + ", ".join(k.__name__ for k in kinds))
    linears = cast(QKVLinear, qkv), cast(Linear, o_proj), cast(GateUpLinear, gate_up), cast(Linear, down)
    dtype = input_norm.weight.dtype
    problem = _fp8_problem(cast(tuple[Fp8Linear, ...], linears)) if fp8 else None
    if not fp8 and any(lin.weight.dtype != dtype for lin in linears):
        problem = f"linear weights not in the model dtype {dtype}"
    if problem is not None:
        return problem
    if linears[1].bias is not None or linears[3].bias is not None:
        return "an o_proj / down_proj bias: the add epilogue takes only the residual"
    if kv_dtype not in (dtype, FP8_KV_DTYPE):
        return f"the KV cache is {kv_dtype}: the qkv epilogue writes the model dtype or float8_e4m3fn only"
    folded = mode == "fused-folded" and not fp8  # FP8: folding g into W would requantize it
    prologue = folded or (mode == "fused-folded" and FP8_PROLOGUE_NORM)
    if folded:  # again after a first fold: W' * 1 is W' exactly, so planning twice changes nothing
        _fold_norm_into(linears[0], input_norm)
        _fold_norm_into(linears[2], post_norm)
    # FP8 weights keep the two GEMVs (the fused MLP has no row-scale path yet).
    mlp_max_m = MLP_MAX_M if fused_mlp and not fp8 else 0
    accumulator = None  # one a layer (16 KB at the 8B shape), allocated outside any graph capture
    if mlp_max_m:
        accumulator = torch.zeros(mlp_max_m * input_norm.weight.shape[0], dtype=torch.float32,
                                  device=input_norm.weight.device)
    return FusedDecode(folded, mlp_max_m, accumulator, prologue_max_m if prologue else 0, pdl, input_norm,
                       linears[0], q_norm, k_norm, rotary, attention, linears[1], post_norm, linears[2], linears[3],
                       pdl_off=setting is False, shard=cast(RowParallelLinear, o_proj).shard if tp else None)


def _fp8_problem(linears: tuple[Fp8Linear, ...]) -> str | None:
    """Why FP8 linears cannot take the fused kernels (they apply one scale per output row), or None."""
    if any(lin.block is not None for lin in linears):
        return "FP8 block scales (128 x 128) change along K: the fused GEMVs take row scales only"
    return None


def fp8_launch(kernel: str, n: int, k: int, num_tokens: int, on_gpu: bool) -> tuple[GemvConfig | None, str]:
    """(launch shape or None for the launcher's own, conversion) of the fused `kernel` ("rope", "silu", "add") on
    FP8 weights [n, k] at M tokens: on the GPU FP8_FUSED_M1 for one token, FP8_FUSED_DOT for more; else (and for
    one-token shapes the table lacks) FP8_WEIGHT_CONVERT, and for o_proj / down the W8A16 GEMV's table. The word
    conversions need K in whole int32 words (every Llama shape), the inline PTX a GPU."""
    tuned = None
    if on_gpu:
        tuned = FP8_FUSED_M1.get((kernel, n, k)) if num_tokens == 1 else FP8_FUSED_DOT.get(kernel)
    config: GemvConfig | None
    if tuned is not None:
        config, convert = tuned
    else:
        convert = FP8_WEIGHT_CONVERT[kernel]
        config = fp8_gemv_config(n, k, num_tokens, True) if kernel == "add" and on_gpu else None
    if k % 4 or (convert.startswith("asm") and not on_gpu):
        convert = "cast"
    return config, convert


def _fp8_args(linear: nn.Module, kernel: str, num_tokens: int) -> dict[str, Any]:
    """fp8_launch's choice as the fused launcher's keywords, with the row scales; none for a plain linear."""
    if not isinstance(linear, Fp8Linear):
        return {}
    n, k = linear.weight.shape
    config, convert = fp8_launch(kernel, n, k, num_tokens, linear.weight.is_cuda)
    return {"weight_scale": linear.weight_scale, "weight_convert": convert, "config": config}


def _unfolded_norm(fd: FusedDecode, norm: RMSNorm, prologue: bool) -> dict[str, Any]:
    """The prologue norm's weight where it is not folded into W (FP8 under "fused-folded"): the GEMV scales x by
    it in its K loop (APPLY_G) after the rms pass. None where the step normalises x first (not `prologue`)."""
    return {"norm_weight": norm.weight} if prologue and not fd.folded else {}


def decode_report(mode: str, pdl: bool, reasons: list[str | None]) -> dict[str, Any]:
    """The startup report's entry: the mode, how many layers are fused and why the others are not."""
    report: dict[str, Any] = {"mode": mode, "pdl": pdl, "fused_layers": 0}
    if mode == "cublas":
        return report
    report["fused_layers"] = sum(r is None for r in reasons)
    fallbacks = sorted({r for r in reasons if r is not None})
    if fallbacks:
        report["fallback"] = "; ".join(fallbacks)
    return report


@torch.no_grad()
def _fold_norm_into(linear: Linear, norm: RMSNorm) -> None:
    weight, gain = linear.weight.data, norm.weight.data
    for start in range(0, weight.shape[0], _FOLD_ROWS):
        rows = weight[start : start + _FOLD_ROWS]
        rows.copy_(fold_norm_weight(rows, gain))
    gain.fill_(1.0)


def takes_fused_decode(hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Decode-only steps of <= GEMV_MAX_M tokens. M is fixed per CUDA-graph bucket, so the branch is taken
    once per bucket at capture and is fixed in its graph."""
    return meta.decode_only and hidden.shape[0] <= GEMV_MAX_M


def fused_decode_layer(
    fd: FusedDecode,
    hidden: torch.Tensor,  # [M, H]
    residual: torch.Tensor | None,  # [M, H]; None after a fused layer (its output is the stream itself)
    positions: torch.Tensor,  # [M] int64
    meta: AttentionMetadata,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LlamaDecoderLayer.forward's semantics for a decode step -> (the new residual stream [M, H], None); under
    MLP_FINISH_IN_QKV (steps of up to fd.mlp_pending_max_m tokens) -> (the MLP's float32 down sums [M, H], the stream
    they are to be added to), which the next layer's qkv finishes: a pending MLP comes in as (hidden, residual)."""
    num_tokens = hidden.shape[0]
    prologue = num_tokens <= fd.prologue_max_m
    carry = fd.carry
    qkv_sums = None
    pending = None  # the previous layer's unfinished MLP: its float32 accumulator [M, H] (MLP_FINISH_IN_QKV)
    if carry is not None and fd.carry_in:  # the previous layer's down / MLP did the input norm's first half
        if residual is not None:  # (the previous MLP's down sums, the stream): this qkv finishes that MLP
            if carry.x_next is not None or hidden.dtype != torch.float32:
                raise ValueError("fused decode: after a fused layer only an unfinished MLP of the folded carried "
                                 "norms (its float32 accumulator, and the stream as the residual) comes with a residual")
            pending, x, stream = hidden, hidden, residual
        else:
            # folded: g is in qkv's weights and x is the stream itself; else x = s * g, stored by the previous down
            x = hidden if carry.x_next is None else carry.x_next[:num_tokens]
            stream, qkv_sums = hidden, carry.sums_next
    elif prologue:  # the qkv GEMV normalises the stream itself
        stream = hidden if residual is None else hidden + residual
        x = stream
    else:  # the norm kernel; a unit gain where g is folded into the weights (fused-folded)
        x, stream = fd.input_norm(hidden, residual, pdl=fd.pdl)
    # the qkv prologue normalises with g folded into W; after an unfinished MLP it makes the stream itself (the
    # rms summed in its K loop) whatever the step's size
    folded = pending is not None or (fd.folded and prologue and qkv_sums is None)
    o_pdl = _o_proj_pdl(fd, num_tokens)  # the attention lets o_proj in early; o_proj loads tiles before its wait
    # NormCarry: the first layer's qkv zeroes sums_post for a clean start; after an unfinished MLP every qkv does (no
    # finishing kernel zeroed the slots that MLP read)
    first_zero = carry.sums_post if carry is not None and (not fd.carry_in or pending is not None) else None
    qkv, qkv_stream = _qkv_rotary_cache(fd, x, positions, meta, k_cache, v_cache, prologue or pending is not None,
                                        folded, qkv_sums, pdl=_qkv_pdl(fd, o_pdl), zero_sums=first_zero,
                                        pending_stream=stream if pending is not None else None)
    if pending is not None:
        stream = qkv_stream  # round(round(acc) + stream), stored by qkv's program 0: o_proj's residual
    num_heads, head_dim = fd.attention.num_heads, fd.attention.head_dim
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    # The decode attention takes PDL on an FP8 cache too (decode_pdl.py converts its early tile as the loop does)
    # unless FP8_CACHE_ATTENTION_PDL is off; launched plainly it starts once qkv has finished, and o_proj's wait
    # (PDL or not) finds it complete.
    attn_pdl = o_pdl and (FP8_CACHE_ATTENTION_PDL or not is_fp8_cache(k_cache))
    out = fd.attention(q, k_cache, v_cache, meta, pdl=attn_pdl).reshape(num_tokens, num_heads * head_dim)
    o_carry: dict[str, Any] = {}
    if carry is not None:  # the post-attention norm's first half; the slots qkv read put back to zero
        x_post = carry.x_post[:num_tokens] if carry.x_post is not None else None
        o_carry = {"carry": NormCarryOut(fd.post_norm.weight if x_post is not None else None, x_post,
                                         carry.sums_post),
                   "zero_sums": carry.sums_next}
        if pending is not None:  # the previous MLP's accumulator, read by qkv: zeroed (NormCarry says why now)
            o_carry["zero_accumulator"] = pending
    # Tensor parallel: rank 0's partial sum takes the residual, the other ranks' do not, and the all-reduce sums them.
    residual_here = fd.shard is None or fd.shard.rank == 0
    stream, _ = gemv_triton(out, fd.o_proj.weight, add=stream if residual_here else None, pdl=o_pdl, **o_carry,
                            **_fp8_args(fd.o_proj, "add", num_tokens))
    stream = _all_reduce(fd, stream)
    mlp_pdl = fd.pdl or (MLP_PDL and not fd.pdl_off)
    finish_early = FINISH_EARLY and not fd.pdl_off
    if carry is not None and carry.x_post is None:  # folded: the fused MLP on the stream and the carried sums
        if num_tokens <= fd.mlp_pending_max_m:  # MLP_FINISH_IN_QKV: the streaming kernel alone; the next qkv finishes
            return fused_mlp_triton(stream, fd.gate_up.weight, fd.down.weight, stream, eps=fd.post_norm.eps,
                                    norm_folded=False, accumulator=fd.mlp_accumulator, norm_sums=carry.sums_post,
                                    pdl=mlp_pdl, finish=False), stream
        return fused_mlp_triton(stream, fd.gate_up.weight, fd.down.weight, stream, eps=fd.post_norm.eps,
                                norm_folded=False, accumulator=fd.mlp_accumulator, norm_sums=carry.sums_post,
                                sums_out=carry.sums_next if fd.next_norm is not None else None,
                                zero_sums=carry.sums_post, pdl=mlp_pdl, finish_early=finish_early), None
    if carry is not None:
        assert carry.x_post is not None and carry.x_next is not None  # the FP8 form carries x too
        act, _ = gemv_triton(carry.x_post[:num_tokens], fd.gate_up.weight, silu_mul=True, norm_sums=carry.sums_post,
                             eps=fd.post_norm.eps, pdl=fd.pdl, **_fp8_args(fd.gate_up, "silu", num_tokens))
        down_carry: dict[str, Any] = {"zero_sums": carry.sums_post}
        if fd.next_norm is not None:
            down_carry["carry"] = NormCarryOut(fd.next_norm.weight, carry.x_next[:num_tokens], carry.sums_next)
        stream, _ = gemv_triton(act, fd.down.weight, add=stream, pdl=fd.pdl, **down_carry,
                                **_fp8_args(fd.down, "add", num_tokens))
        return stream, None
    x = stream if prologue else fd.post_norm(stream, pdl=fd.pdl)[0]
    residual = stream if residual_here else None
    if num_tokens <= fd.mlp_max_m:  # gate_up + SiLU-mul + down + residual: a streaming kernel, a finishing one
        return _all_reduce(fd, fused_mlp_triton(x, fd.gate_up.weight, fd.down.weight, residual, eps=fd.post_norm.eps,
                                                norm_folded=fd.folded and prologue, accumulator=fd.mlp_accumulator,
                                                pdl=mlp_pdl, finish_early=finish_early)), None
    act, _ = gemv_triton(x, fd.gate_up.weight, silu_mul=True, norm_folded=fd.folded and prologue,
                         eps=fd.post_norm.eps, pdl=fd.pdl, **_fp8_args(fd.gate_up, "silu", num_tokens),
                         **_unfolded_norm(fd, fd.post_norm, prologue))
    stream, _ = gemv_triton(act, fd.down.weight, add=residual, pdl=fd.pdl, **_fp8_args(fd.down, "add", num_tokens))
    return _all_reduce(fd, stream), None


def _all_reduce(fd: FusedDecode, partial: torch.Tensor) -> torch.Tensor:
    """The stream from this rank's partial sum of a row-parallel GEMV (its shard's all-reduce, in place); on one
    GPU the GEMV's output already is the stream."""
    return partial if fd.shard is None else fd.shard.comm.all_reduce(partial)


def _o_proj_pdl(fd: FusedDecode, num_tokens: int) -> bool:
    """Whether the attention and o_proj launch with PDL: in a PDL chain, and under O_PROJ_PDL (unless decode_pdl is
    False) where the bf16 o_proj launch at this many tokens loads more than one K tile before its wait."""
    if fd.pdl:
        return True
    if not O_PROJ_PDL or fd.pdl_off or isinstance(fd.o_proj, Fp8Linear):
        return False
    weight = fd.o_proj.weight
    n, k = weight.shape
    return gemv.gemv_config("plain", num_tokens, n, k, weight.is_cuda, weight.element_size()).pdl_tiles > 1


def _qkv_pdl(fd: FusedDecode, o_pdl: bool) -> bool:
    """Whether the qkv GEMV launches with PDL: in a PDL chain, and under QKV_PDL wherever the attention and o_proj do
    (_o_proj_pdl: bf16 at one token on the 8B entry; never with decode_pdl False)."""
    return fd.pdl or (QKV_PDL and o_pdl)


def _qkv_rotary_cache(
    fd: FusedDecode,
    x: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prologue: bool,
    folded: bool,
    norm_sums: torch.Tensor | None = None,
    pdl: bool = False,
    zero_sums: torch.Tensor | None = None,
    pending_stream: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv [M, (Hq + 2 Hkv) D] with q and k rotated, the stream); k and v written to the caches (slot -1: padding).
    prologue: x is the stream, normalised in the GEMV's prologue (folded: with g in the weights); norm_sums: x is
    s * g of a carried norm (NormCarry), these its slots; else x is already normalised. pending_stream (with prologue
    and folded): x is the previous MLP's float32 accumulator and this the stream it adds to (MLP_FINISH_IN_QKV); the
    returned stream is then the new one, round(round(x) + pending_stream), else x. pdl: launch with programmatic
    dependent launch. zero_sums: a carried norm's slots this launch zeroes after its wait. An FP8 cache stores
    k / k_scale and v / v_scale with the attention module's scales (the kernel reads them only for a float8_e4m3fn
    cache)."""
    q_norm = fd.q_norm.weight if fd.q_norm is not None else None
    k_norm = fd.k_norm.weight if fd.k_norm is not None else None
    # One eps serves the prologue norm and Qwen3's q/k norm: the model builds all of them from rms_norm_eps.
    eps = fd.input_norm.eps if prologue or norm_sums is not None or fd.q_norm is None else fd.q_norm.eps
    fp8 = _fp8_args(fd.qkv, "rope", x.shape[0])
    if q_norm is not None and fp8.get("weight_convert", "cast") != "cast" and gemv.REFUSE_WORDS_WITH_QK_NORM:
        fp8["weight_convert"] = "cast"  # refused with the q/k norm on CUDA (see gemv_rotary_cache_triton)
    qkv, stream = gemv_rotary_cache_triton(
        x, fd.qkv.weight, fd.qkv.bias, num_heads=fd.attention.num_heads, num_kv_heads=fd.attention.num_kv_heads,
        positions=positions, cos_sin=fd.rotary.cos_sin, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=meta.slot_mapping, eps=eps, q_norm=q_norm, k_norm=k_norm, pdl=pdl,
        pdl_trigger_first=pdl and QKV_TRIGGER_FIRST,
        norm_folded=folded, norm_sums=norm_sums, zero_sums=zero_sums, k_scale=fd.attention.k_scale,
        v_scale=fd.attention.v_scale, norm_residual=pending_stream, x_accumulator=pending_stream is not None,
        **fp8, **_unfolded_norm(fd, fd.input_norm, prologue),
    )
    return qkv, stream
