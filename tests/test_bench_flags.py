"""ops/bench.py's --decode-kernels items: the kernel-module switches an item sets for its own engine only."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")
from stoker.engine.kernels import attention, decode_fp8_mma  # noqa: E402
from stoker.engine.models import fused_decode  # noqa: E402
from stoker.ops import bench  # noqa: E402


def test_set_items_change_a_module_constant_for_their_item_only() -> None:
    tile, carry, opdl = attention.DECODE_TILE_N, fused_decode.NORM_CARRY, fused_decode.O_PROJ_PDL
    try:
        bench.apply_kernel_flags("auto+set=attention.DECODE_TILE_N=32+nocarry")
        assert attention.DECODE_TILE_N == 32 and fused_decode.NORM_CARRY is False
        assert bench.decode_setting("auto+set=attention.DECODE_TILE_N=32+nocarry") == {"decode_kernels": "auto"}
        bench.apply_kernel_flags(f"auto+set=fused_decode.O_PROJ_PDL={not opdl}")
        assert tile == attention.DECODE_TILE_N and fused_decode.NORM_CARRY is carry
        assert fused_decode.O_PROJ_PDL is (not opdl)
        bench.apply_kernel_flags("auto")
        assert fused_decode.O_PROJ_PDL is opdl and tile == attention.DECODE_TILE_N
        stages = decode_fp8_mma.STAGES
        bench.apply_kernel_flags(f"auto+set=decode_fp8_mma.STAGES={stages + 2}")
        assert stages + 2 == decode_fp8_mma.STAGES
        bench.apply_kernel_flags("auto")
        assert stages == decode_fp8_mma.STAGES
    finally:
        bench.apply_kernel_flags("auto")


def test_set_items_switch_the_mlp_finish_into_the_next_qkv() -> None:
    """The A/B of fused_decode.MLP_FINISH_IN_QKV (and its token cap), which the model reads when it plans its decode,
    i.e. after the item's flags are applied: set for that item's engine, back to the module's values for the next."""
    assert fused_decode.MLP_FINISH_IN_QKV is True and fused_decode.MLP_FINISH_IN_QKV_MAX_M == 1  # the H200's pick
    item = "auto+set=fused_decode.MLP_FINISH_IN_QKV=False+set=fused_decode.MLP_FINISH_IN_QKV_MAX_M=16"
    try:
        bench.apply_kernel_flags(item)
        assert fused_decode.MLP_FINISH_IN_QKV is False and fused_decode.MLP_FINISH_IN_QKV_MAX_M == 16
        assert bench.decode_setting(item) == {"decode_kernels": "auto"}
        bench.apply_kernel_flags("auto")
        assert fused_decode.MLP_FINISH_IN_QKV is True and fused_decode.MLP_FINISH_IN_QKV_MAX_M == 1
    finally:
        bench.apply_kernel_flags("auto")


@pytest.mark.parametrize("item, message", [
    ("auto+set=attention.DECODE_TILE_N", "set=MODULE.NAME=VALUE"),
    ("auto+set=sampler.X=1", "set=MODULE.NAME=VALUE"),
    ("auto+set=fused_decode.O_PROJ_PDL=1", "is a bool"),
    ("auto+set=fused_decode.FP8_FUSED_M1=1", "not a number or a bool"),
])
def test_set_items_refuse_what_they_cannot_set(item: str, message: str) -> None:
    try:
        with pytest.raises(ValueError, match=message):
            bench.apply_kernel_flags(item)
    finally:
        bench.apply_kernel_flags("auto")


def test_gemv_shapes_parse_with_their_options() -> None:
    from stoker.engine.kernels.gemv import GemvConfig

    assert bench.parse_gemv_shape("1x4x2048w4s3p2r64") == GemvConfig(1, 4, 2048, False, 4, 3, 2, 64)
    assert bench.parse_gemv_shape("16x16x256w1s4dot") == GemvConfig(16, 16, 256, True, 1, 4)
    assert GemvConfig(1, 4, 2048, False, 4, 3, 2, 64).label() == "cores 1x4x2048 w4 s3 p2 r64"
    with pytest.raises(ValueError, match="maxnreg must be 24-255"):
        GemvConfig(1, 4, 2048, False, 4, 3, maxnreg=8)


def test_repeated_decode_items_keep_every_run_in_the_table() -> None:
    """An A/B that repeats its items (auto,X,auto,X) shows each run's TPOT in its row, in run order: the table kept
    only the last run of a repeated item before (session 19's A/Bs had to be read from the log)."""
    def run(tpot: float, mhz: float | None = None) -> dict:
        return {"tpot_ms": tpot, "x_floor": tpot / 3.5, "decode": {"fused_layers": 32}, "sm_mhz_median": mhz}

    r = {"w1": {"floor_ms": 3.5}, "w1_by_decode": {"auto": [run(4.061), run(4.064)],
                                                   "auto+nocarry": [run(4.09, 1980.0), run(4.2)]}}
    rows = bench.w1_decode_rows(r)
    assert [row[:2] for row in rows] == [("W1 TPOT, decode auto", "4.061, 4.064 ms"),
                                         ("W1 TPOT, decode auto+nocarry", "4.090, 4.200 ms")]
    assert rows[0][4] == "1.160, 1.161x floor; fused layers 32"  # no clock sampled: none shown
    assert rows[1][4] == "1.169, 1.200x floor; fused layers 32; SM MHz 1980, -"  # each run's W1 clock
    assert bench.w1_decode_rows({"w1": {"floor_ms": 3.5}, "w1_by_decode": {"auto": [run(4.0), run(4.1)]}})
    assert not bench.w1_decode_rows({"w1": {"floor_ms": 3.5}, "w1_by_decode": {"auto": [run(4.0)]}})


def test_dummy_folder_holds_no_weights_and_the_engine_runs_on_it(tmp_path) -> None:
    """--load-format dummy: write_model writes the config and tokenizer alone, and the bench's engine settings
    take the dummy load (on the CPU here, the tiny shape)."""
    from stoker.engine import EngineRequest, LLMEngine, SamplingParams

    path = str(tmp_path / "tiny-dummy")
    bench.write_model(path, bench.SHAPES["tiny"], device="cpu", weights=False)
    assert sorted(os.listdir(path)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    config = bench.engine_config(path, 4, device="cpu", load_format="dummy")
    assert config.load_format == "dummy"
    config.num_kv_blocks = 64
    eng = LLMEngine(config)
    eng.add_request(EngineRequest("r", prompt_token_ids=list(range(3, 40)),
                                  params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error_code is None, out
            tokens += out.new_token_ids
    assert len(tokens) == 4 and eng.runner.startup["load_format"] == "dummy"


def test_the_70b_shape_is_llama_3_70b(tmp_path) -> None:
    """The folder --shape 70b --load-format dummy writes, read by the engine's own config parser: its dummy layout
    holds Llama-3-70B's 70.55 B parameters (80 layers, hidden 8192, 64 / 8 heads, intermediate 28,672, untied
    128,256-token embedding and LM head)."""
    from stoker.engine.dummy_load import checkpoint_layout
    from stoker.engine.model_config import ModelConfig

    path = str(tmp_path / "70b")
    bench.write_model(path, bench.SHAPES["70b"], device="cpu", weights=False)
    mc = ModelConfig.from_folder(path)
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.intermediate_size) == (
        80, 8192, 64, 8, 28672)
    params = sum(math.prod(s) for _, s, _ in checkpoint_layout(mc))
    assert params == 70_553_706_496


def test_the_8b_rank2_shape_is_one_rank_of_the_8b_at_tp2(tmp_path) -> None:
    """--shape 8b-rank2 is what rank 0 of the 8B at TP = 2 holds (the engine's own split of the 8B's config): its
    W1 on one GPU is that rank's kernels without the all-reduces."""
    from stoker.engine.model_config import ModelConfig
    from stoker.engine.parallel.plan import rank_model_config

    def read(shape: str) -> ModelConfig:
        bench.write_model(str(tmp_path / shape), bench.SHAPES[shape], device="cpu", weights=False)
        return ModelConfig.from_folder(str(tmp_path / shape))

    rank = rank_model_config(read("8b"), 0, 2, comm=None)
    alone = read("8b-rank2")
    fields = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
    assert [getattr(alone, f) for f in fields] == [getattr(rank, f) for f in fields]


def test_the_written_bench_model_is_the_dummy_checkpoint(tmp_path) -> None:
    """write_model's shards hold exactly the tensors engine/dummy_load.py makes for the same config (names, shapes,
    bf16 values, on the same device), the embedding in the first shard and the LM head in the last, and the engine
    loads the folder."""
    from safetensors import safe_open
    from stoker.engine import LLMEngine
    from stoker.engine.dummy_load import checkpoint_layout, dummy_tensor
    from stoker.engine.model_config import ModelConfig

    path = str(tmp_path / "tiny")
    bench.write_model(path, bench.SHAPES["tiny"], device="cpu")
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(shards) == 4
    tensors: dict[str, tuple[str, torch.Tensor]] = {}
    for shard in shards:
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            tensors.update({k: (shard, f.get_tensor(k)) for k in f.keys()})  # noqa: SIM118
    layout = checkpoint_layout(ModelConfig.from_folder(path))
    assert sorted(tensors) == sorted(name for name, _, _ in layout)
    for name, shape, fill in layout:
        assert torch.equal(tensors[name][1], dummy_tensor(name, shape, fill, torch.bfloat16, "cpu")), name
    assert tensors["model.embed_tokens.weight"][0] == shards[0] and tensors["lm_head.weight"][0] == shards[-1]
    config = bench.engine_config(path, 4, device="cpu")
    config.num_kv_blocks = 64
    LLMEngine(config).close()


def test_set_item_turns_the_epilogue_residual_add_off() -> None:
    """W2's A/B of Linear.forward_add's epilogue add: off for the item's engine, on again for the next."""
    from stoker.engine.layers import linear

    assert linear.EPILOGUE_ADD is True
    try:
        bench.apply_kernel_flags("auto+set=linear.EPILOGUE_ADD=False")
        assert linear.EPILOGUE_ADD is False
        bench.apply_kernel_flags("auto")
        assert linear.EPILOGUE_ADD is True
    finally:
        bench.apply_kernel_flags("auto")
