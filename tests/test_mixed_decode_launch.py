"""A mixed step's decode rows launch only decode-kernel variants that the CUDA-graph capture compiled (issue 13).

Triton compiles a variant per set of constexprs (NUM_SPLITS, FUSED_COMBINE, ...) and per specialization class of
the other arguments (pointer 16-byte alignment, an int's == 1 / % 16 == 0): a variant first met mid-run costs ~1 s
of host inside a step. On a fresh H200 W2 compiled two (BENCHMARKS.md, 18:57 UTC): decode rows launched at their
own split count with the two-kernel combine, which no graph bucket takes. Here, on the CPU, with the H200's
launch parameters (132 SMs, 64-key tiles) and the 8B attention shape, the decode kernels are replaced by
recorders of their specialization keys; the capture's launches (every bucket's decode-only metadata, exactly as
DecodeGraphs builds it) are enumerated against every launch a mixed step can make (every count of decode rows
the runner splits off, each class of block-table width up to max_model_len)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":  # (the fixture below sets it only for check_launchable, after import)
    pytest.skip("records the JIT's specialization keys (kernel.params), which the interpreter's functions lack",
                allow_module_level=True)
pytest.importorskip("triton")
from stoker.engine import kernels  # noqa: E402
from stoker.engine.batch import AttentionMetadata  # noqa: E402
from stoker.engine.config import EngineConfig  # noqa: E402
from stoker.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from stoker.engine.engine import LLMEngine  # noqa: E402
from stoker.engine.kernels import attention as attention_kernels  # noqa: E402
from stoker.engine.layers.attention import PagedAttention  # noqa: E402
from stoker.engine.model_runner import mixed_decode_rows  # noqa: E402

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # the 8B shape's attention, the engine's default block
MAX_NUM_SEQS = MAX_MODEL_LEN = 1024  # ops/bench.py's W2 engine
H200_SMS, CUDA_TILE_N = 132, 64


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` adds the launch's specialization key
    (what Triton compiles a variant per) to `keys` instead of running it."""

    def __init__(self, kernel: Any, keys: set[tuple[Any, ...]]) -> None:
        self.kernel, self.keys = kernel, keys

    def __getitem__(self, grid: object) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.keys.add((self.kernel.fn.__name__, *self._classes(args), *sorted(kwargs.items())))

        return launch

    def _classes(self, args: tuple[Any, ...]) -> list[Any]:
        out: list[Any] = []
        for param, arg in zip(self.kernel.params, args, strict=False):
            if param.do_not_specialize:
                out.append((param.name, "any"))
            elif isinstance(arg, torch.Tensor):
                out.append((param.name, arg.dtype, arg.data_ptr() % 16 == 0))
            elif isinstance(arg, bool) or not isinstance(arg, int):
                out.append((param.name, type(arg).__name__))
            else:
                out.append((param.name, arg == 1, arg % 16 == 0))
        return out


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> set[tuple[Any, ...]]:
    """The decode kernels recorded, the prefill kernel skipped, the H200's SM count and CUDA key tile, and the
    Triton launchers taken for CPU tensors (nothing runs: only the launch decisions are made)."""
    keys: set[tuple[Any, ...]] = set()
    for name in ("_decode_split_kernel", "_decode_reduce_kernel"):
        monkeypatch.setattr(attention_kernels, name, Recorder(getattr(attention_kernels, name), keys))
    monkeypatch.setattr(attention_kernels, "_prefill_kernel", Recorder(attention_kernels._prefill_kernel, set()))
    monkeypatch.setattr(attention_kernels, "_sm_count", lambda device: H200_SMS)
    monkeypatch.setattr(attention_kernels, "_decode_tile_n", lambda q, k_cache, fp8_config: CUDA_TILE_N)
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # check_launchable lets CPU tensors through
    return keys


@pytest.fixture(scope="module")
def runner(tiny_model: str) -> Any:
    """A CPU engine's runner with W2's limits: its mixed-step decode launch rule is the one under test."""
    engine = LLMEngine(EngineConfig(model_path=tiny_model, device="cpu", max_num_seqs=MAX_NUM_SEQS,
                                    max_model_len=MAX_MODEL_LEN, num_kv_blocks=64))
    return engine.runner


def qkv_view(num_tokens: int) -> torch.Tensor:
    """q as the model passes it: a view of the fused qkv output (rows strided past the k and v columns)."""
    qkv = torch.empty(num_tokens, (HQ + 2 * HKV) * HEAD_DIM, dtype=torch.bfloat16)
    return qkv[:, : HQ * HEAD_DIM].view(num_tokens, HQ, HEAD_DIM)


def capture_keys(recorded: set[tuple[Any, ...]]) -> set[tuple[Any, ...]]:
    """Every bucket's decode-only attention as DecodeGraphs.capture runs it (its static metadata per bucket)."""
    graphs = DecodeGraphs(None, [], torch.device("cpu"), BLOCK_SIZE, MAX_NUM_SEQS, MAX_MODEL_LEN)  # type: ignore[arg-type]
    layer = PagedAttention(HQ, HKV, HEAD_DIM, HEAD_DIM**-0.5)
    k_cache = torch.empty(4, BLOCK_SIZE, HKV, HEAD_DIM, dtype=torch.bfloat16)
    for bucket in graphs.sizes:
        layer(qkv_view(bucket), k_cache, k_cache.clone(), graphs._meta[bucket])
    keys = set(recorded)
    recorded.clear()
    return keys


def mixed_launches(runner: Any, recorded: set[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[int, int]]:
    """Every mixed step shape the runner can launch: num_decodes decode sequences and one prompt chunk, its
    split of decode rows, over the block-table widths -> each key recorded, with one (rows, width) making it."""
    layer = PagedAttention(HQ, HKV, HEAD_DIM, HEAD_DIM**-0.5)
    k_cache = torch.empty(4, BLOCK_SIZE, HKV, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    max_blocks = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    chunk = 5  # the prompt chunk's tokens
    q_all = qkv_view(MAX_NUM_SEQS + chunk)
    found: dict[tuple[Any, ...], tuple[int, int]] = {}
    # The decode launch depends on the rows split off, not on the 0-3 left with the prompt chunk: one count each.
    splits = {mixed_decode_rows(n, n + 1, True): n for n in range(1, MAX_NUM_SEQS)}
    splits.pop(0, None)
    # A width enters the launch only through its tokens over the key tile (the split count's cap): the first and
    # last width of each such class (16-token blocks, 64-key tiles: widths 1, 4, 5, 8, .., 61, 64).
    per_tile = CUDA_TILE_N // BLOCK_SIZE
    widths = sorted({w for c in range(1, -(-max_blocks // per_tile) + 1)
                     for w in ((c - 1) * per_tile + 1, min(c * per_tile, max_blocks))})
    for width in widths:
        tables = torch.zeros(MAX_NUM_SEQS, width, dtype=torch.int32)
        for rows, num_decodes in splits.items():
            num_seqs = num_decodes + 1
            qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
            qsl[-1] = qsl[-2] + chunk
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), block_tables=tables[:num_seqs],
                query_start_loc=qsl, context_lens=torch.ones(num_seqs, dtype=torch.int32), decode_only=False,
                num_decodes=rows, prompt_query_start_loc=qsl[rows:] - rows, decode_launch=runner._decode_launch(rows),
            )
            layer(q_all[: int(qsl[-1])], k_cache, v_cache, meta)
            for key in recorded - found.keys():
                found[key] = (rows, width)
            recorded.clear()
    return found


def test_mixed_decode_rows_launch_only_captured_variants(runner: Any, recorded: set[tuple[Any, ...]]) -> None:
    captured = capture_keys(recorded)
    assert len({k[0] for k in captured}) == 2  # both the split and the reduce kernel took part (bucket 2: 16 splits)
    mixed = mixed_launches(runner, recorded)
    assert mixed, "no mixed launch was recorded"
    new = {key: made_by for key, made_by in mixed.items() if key not in captured}
    assert not new, "mixed-step decode launches compiling variants no capture compiled (rows, table width): " + \
        "; ".join(f"{made_by}: {dict(k for k in key[1:] if isinstance(k, tuple) and len(k) == 2)}"
                  for key, made_by in list(new.items())[:4])


def test_runner_marks_mixed_steps_with_the_graph_launch(tiny_model: str) -> None:
    """A real mixed step's metadata carries the decode launch of the bucket holding its decode rows, over the
    graphs' static table width (what the invariant above assumes the runner sends)."""
    engine = LLMEngine(EngineConfig(model_path=tiny_model, device="cpu", max_num_seqs=16, max_model_len=256,
                                    max_num_batched_tokens=24, num_kv_blocks=64))
    from stoker.engine import EngineRequest, SamplingParams

    seen: list[AttentionMetadata] = []
    to_device = engine.runner.to_device

    def spy(packed: Any, prev_tokens: Any) -> Any:
        inp = to_device(packed, prev_tokens)
        seen.append(inp.meta)
        return inp

    engine.runner.to_device = spy  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(5):
        engine.add_request(EngineRequest(f"d{i}", prompt_token_ids=[3 + i, 4, 5], params=greedy))
    engine.step()
    engine.add_request(EngineRequest("long", prompt_token_ids=list(range(3, 60)), params=greedy))
    while engine.has_unfinished():
        engine.step()
    mixed = [m for m in seen if m.num_decodes]
    assert mixed, "no mixed step split off decode rows"
    for meta in mixed:
        # 5 decoders -> 4 rows split off -> bucket 4; the table: 256 tokens / 16 per block = 16 blocks
        assert meta.decode_launch == (4, 256), meta.decode_launch
    assert all(m.decode_launch is None for m in seen if not m.num_decodes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_steps_compile_no_decode_variant_after_capture(tiny_model: str) -> None:
    """On the GPU: after the engine's start (graph capture), mixed steps carrying 4..44 decode rows of short
    contexts launch no new variant of the decode kernels (before the fix, such rows took 1 split at their eager
    table width, a count no bucket of a 256-token table compiled)."""
    from stoker.engine import EngineRequest, SamplingParams

    engine = LLMEngine(EngineConfig(model_path=tiny_model, device="cuda", dtype="bfloat16", max_num_seqs=48,
                                    max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=64))
    assert engine.runner.graphs is not None

    def variants() -> int:
        return sum(len(c[0]) for fn in (attention_kernels._decode_split_kernel, attention_kernels._decode_reduce_kernel)
                   for c in fn.device_caches.values())

    splits: list[int] = []
    to_device = engine.runner.to_device
    engine.runner.to_device = lambda packed, prev: (splits.append(packed.num_decodes), to_device(packed, prev))[1]
    before = variants()
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(47):  # one new request a step: each step mixes its prompt with the others' decode rows
        engine.add_request(EngineRequest(f"r{i}", prompt_token_ids=[3 + i % 50, 5, 7], params=params))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert {12, 20, 28, 44} <= set(splits), sorted(set(splits))
    assert variants() == before
