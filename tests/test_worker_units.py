"""Worker parts that need no broker: offset watermarks, the stand-in engine, the engine thread, config."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
from stoker.engine import EngineRequest, SamplingParams
from stoker.engine.outputs import EngineRequestError, RequestOutput
from stoker.worker.config import WorkerConfig
from stoker.worker.driver import EngineDriver, EngineStalled
from stoker.worker.fake_engine import FAIL_MARKER, FakeEngine, fake_token_id, fake_token_text
from stoker.worker.main import parse_config
from stoker.worker.metrics import TenantLabels
from stoker.worker.offsets import OffsetTracker


# -- offsets ------------------------------------------------------------------------------------------------
def test_watermark_waits_for_the_lowest_offset_in_flight():
    t = OffsetTracker()
    for off in range(10, 15):
        t.track("p0", off)
    assert t.watermark("p0") == 10
    t.finish("p0", 12)
    t.finish("p0", 11)
    assert t.watermark("p0") == 10  # 10 still running: nothing past it may be committed
    t.finish("p0", 10)
    assert t.watermark("p0") == 13
    t.finish("p0", 14)
    t.finish("p0", 13)
    assert t.watermark("p0") == 15  # all done: one past the highest seen
    assert t.to_commit() == {"p0": 15}
    t.mark_committed("p0", 15)
    assert t.to_commit() == {}


def test_watermark_random_order_matches_reference():
    rng = random.Random(7)
    t = OffsetTracker()
    offsets = list(range(100, 400))
    for off in offsets:
        t.track("p", off)
        if rng.random() < 0.1:
            t.track("p", off)  # a duplicate delivery changes nothing
    done: set[int] = set()
    order = offsets[:]
    rng.shuffle(order)
    for off in order:
        t.finish("p", off)
        done.add(off)
        expected = min((o for o in offsets if o not in done), default=offsets[-1] + 1)
        assert t.watermark("p") == expected
    assert t.in_flight_count() == 0


def test_forgotten_partition_ignores_late_finishes():
    t = OffsetTracker()
    t.track("a", 5)
    t.track("b", 1)
    t.forget("a")
    t.finish("a", 5)  # revoked meanwhile: no error, no commit
    assert t.watermark("a") is None
    assert set(t.to_commit()) == {"b"}


# -- the stand-in engine ------------------------------------------------------------------------------------
def _run_to_end(engine: FakeEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_fake_engine_is_deterministic_and_respects_max_tokens():
    engine = FakeEngine(vocab_size=1000)
    engine.add_request(EngineRequest("r1", prompt="hello there", params=SamplingParams(max_tokens=5)))
    outs = _run_to_end(engine)["r1"]
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == [fake_token_id("r1", i, 1000) for i in range(5)]
    assert "".join(o.text_delta for o in outs) == "".join(fake_token_text(t) for t in ids)
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 5
    assert outs[-1].prompt_tokens == 2


def test_fake_engine_priority_order_when_the_batch_is_full():
    engine = FakeEngine(max_num_seqs=1)
    for rid, prio in (("low", 5), ("high", -1), ("mid", 0)):
        engine.add_request(EngineRequest(rid, prompt="x", params=SamplingParams(max_tokens=2), priority=prio))
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "mid", "low"]


def test_fake_engine_abort_deadline_stop_and_errors():
    engine = FakeEngine(max_model_len=50)
    engine.add_request(EngineRequest("cancel-me", prompt="x", params=SamplingParams(max_tokens=40)))
    engine.add_request(EngineRequest("late", prompt="x", params=SamplingParams(max_tokens=40), deadline_ms=time.time() * 1000 - 1))
    engine.add_request(EngineRequest("boom", prompt=f"x {FAIL_MARKER}", params=SamplingParams(max_tokens=3)))
    text = "".join(fake_token_text(fake_token_id("stopper", i, engine.vocab_size)) for i in range(3))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine.add_request(EngineRequest("stopper", prompt="x", params=SamplingParams(max_tokens=40, stop=(stop,))))
    first = engine.step()
    engine.abort("cancel-me")
    outs = _run_to_end(engine)
    for out in first:
        outs[out.request_id].insert(0, out) if out.request_id in outs else outs.setdefault(out.request_id, [out])
    assert outs["cancel-me"][-1].finish_reason == "cancelled"
    assert outs["late"][-1].finish_reason == "deadline" and not outs["late"][-1].new_token_ids
    assert outs["boom"][-1].error_code == "internal" and outs["boom"][-1].finished
    streamed = "".join(o.text_delta for o in outs["stopper"])
    assert outs["stopper"][-1].finish_reason == "stop" and stop not in streamed
    assert text.startswith(streamed)
    with pytest.raises(EngineRequestError) as exc:
        engine.add_request(EngineRequest("long", prompt="a b c", params=SamplingParams(max_tokens=48)))
    assert exc.value.code == "context_length_exceeded"


# -- engine thread ------------------------------------------------------------------------------------------
async def test_driver_delivers_every_step_and_sleeps_when_idle():
    loop = asyncio.get_running_loop()
    got: list[RequestOutput] = []
    done = asyncio.Event()
    engine = FakeEngine()

    def sink(outputs, stats, step_ms):
        got.extend(outputs)
        driver.published()
        if any(o.finished for o in outputs):
            done.set()

    driver = EngineDriver(engine, loop, sink)
    driver.start()
    try:
        driver.add_request(EngineRequest("a", prompt="p", params=SamplingParams(max_tokens=20)))
        await asyncio.wait_for(done.wait(), 5)
        assert [t for o in got for t in o.new_token_ids] == [fake_token_id("a", i, engine.vocab_size) for i in range(20)]
        steps = driver.steps
        await asyncio.sleep(0.3)
        assert driver.steps == steps  # no work, no steps
    finally:
        driver.stop()


async def test_driver_stops_stepping_while_outputs_are_unpublished():
    loop = asyncio.get_running_loop()
    batches: list[int] = []
    engine = FakeEngine()
    driver = EngineDriver(engine, loop, lambda outs, stats, ms: batches.append(len(outs)), max_unpublished_steps=3)
    driver.start()
    try:
        driver.add_request(EngineRequest("a", prompt="p", params=SamplingParams(max_tokens=100)))
        await asyncio.sleep(0.3)
        assert driver.steps == 3 and len(batches) == 3  # held at the limit: nothing published yet
        driver.published()
        await asyncio.sleep(0.1)
        assert driver.steps == 4
    finally:
        driver.stop()


async def test_driver_reports_an_engine_whose_stats_fail_instead_of_dying_silently():
    """engine.stats() runs on the engine thread after every step; if it raised, the thread died without a
    word (no fatal, no sink call): the worker looked healthy and never stepped again."""

    class BrokenStats(FakeEngine):
        def stats(self):  # type: ignore[override]
            raise RuntimeError("stats broke")

    loop = asyncio.get_running_loop()
    calls: list[tuple[int, object]] = []
    called = asyncio.Event()

    def sink(outputs, stats, step_ms):
        calls.append((len(outputs), driver.fatal))
        called.set()

    driver = EngineDriver(BrokenStats(), loop, sink)
    driver.start()
    try:
        driver.add_request(EngineRequest("a", prompt="p", params=SamplingParams(max_tokens=5)))
        await asyncio.wait_for(called.wait(), 5)
        assert calls == [(0, driver.fatal)] and isinstance(driver.fatal, RuntimeError)
    finally:
        driver.stop()


class _HeldStep(FakeEngine):
    """The stand-in whose steps from the `hold_from`-th on wait for `release` (a hung GPU's stand-in); `failure`
    as LLMEngine.failure reports a dead tensor-parallel rank."""

    def __init__(self, hold_from: int = 0) -> None:
        super().__init__()
        self.hold_from = hold_from
        self.release = threading.Event()
        self.failure: str | None = None

    def step(self):  # type: ignore[no-untyped-def,override]
        if self.steps >= self.hold_from:
            self.release.wait()
        return super().step()


async def _step_in_flight(driver: EngineDriver, steps_done: int = 0) -> float:
    """Wait until the driver's step after `steps_done` finished ones is in progress -> when it started."""
    for _ in range(100):
        if driver.step_started is not None and driver.steps == steps_done:
            break
        await asyncio.sleep(0.01)
    started = driver.step_started
    assert started is not None and driver.steps == steps_done
    return started


async def test_driver_declares_a_step_past_the_limit_stalled_and_drops_its_late_outputs():
    """A step that never ends by itself (the stand-in's hang hook, a hung GPU's stand-in): stalled() says
    nothing while the step is young or no step runs, then returns EngineStalled and marks the engine broken; if
    the step does come back after all, its outputs go nowhere."""
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def sink(outputs, stats, step_ms):
        got.append(len(outputs))
        driver.published()

    engine = _HeldStep(hold_from=2)
    driver = EngineDriver(engine, loop, sink)
    assert driver.stalled(0.1) is None  # no step yet
    driver.start()
    try:
        driver.add_request(EngineRequest("a", prompt="p", params=SamplingParams(max_tokens=50)))
        await _step_in_flight(driver, steps_done=2)  # the third step is in, and stays
        assert driver.stalled(5.0) is None and driver.fatal is None  # young still
        assert driver.stalled(0) is None  # 0 = the watchdog is off
        await asyncio.sleep(0.3)
        stalled = driver.stalled(0.2)
        assert isinstance(stalled, EngineStalled) and driver.fatal is stalled
        assert "step_stall_timeout_s 0.2" in str(stalled)
        delivered = len(got)
        engine.release.set()  # it comes back after all: the thread ends without handing its outputs over
        await asyncio.sleep(0.2)
        assert len(got) == delivered and driver.steps == 2
    finally:
        engine.release.set()
        driver.stop()


async def test_driver_does_not_count_a_noted_pause_as_a_steps_time():
    """A process stopped (SIGSTOP, a frozen VM) with a step in flight: the watchdog notes the gap in its ticks,
    and stalled() counts only the time the step could run, so a resumed worker is not taken for a hung one."""
    engine = _HeldStep()
    driver = EngineDriver(engine, asyncio.get_running_loop(), lambda *a: driver.published())
    driver.start()
    try:
        driver.add_request(EngineRequest("a", prompt="p", params=SamplingParams(max_tokens=5)))
        started = await _step_in_flight(driver)
        await asyncio.sleep(0.5)
        driver.note_pause(started - 5.0, started + 0.1)  # partly before the step: only its overlap counts
        driver.note_pause(started + 0.15, started + 0.45)
        assert driver.stalled(0.3) is None and driver.fatal is None  # ran ~0.1 s of its ~0.5
        await asyncio.sleep(0.35)
        stalled = driver.stalled(0.3)  # now ~0.45 s of running time: stalled
        assert isinstance(stalled, EngineStalled) and driver.fatal is stalled
    finally:
        engine.release.set()
        driver.stop()


async def test_driver_ends_a_stuck_step_soon_once_the_engine_reports_a_failure():
    """A tensor-parallel rank dies inside a one-shot all-reduce: the engine knows (LLMEngine.failure, from the
    ranks' watchdog) but its step never returns. stalled() then gives up after the short grace, not the whole
    stall limit, and names the failure."""
    engine = _HeldStep()
    driver = EngineDriver(engine, asyncio.get_running_loop(), lambda *a: driver.published())
    driver.start()
    try:
        driver.add_request(EngineRequest("a", prompt="p", params=SamplingParams(max_tokens=5)))
        await _step_in_flight(driver)
        await asyncio.sleep(0.3)
        assert driver.stalled(300, failed_grace_s=0.1) is None  # stuck, but the engine has not failed
        engine.failure = "tensor-parallel rank 1 (pid 7) exited with code -9"
        stalled = driver.stalled(300, failed_grace_s=0.1)
        assert isinstance(stalled, EngineStalled) and "rank 1 (pid 7) exited" in str(stalled)
    finally:
        engine.release.set()
        driver.stop()


def test_driver_thread_is_idle_without_work():
    loop = asyncio.new_event_loop()
    driver = EngineDriver(FakeEngine(), loop, lambda *a: None)
    driver.start()
    try:
        thread = next(t for t in threading.enumerate() if t.name == "stoker-engine")
        time.sleep(0.3)
        assert thread.is_alive() and driver.steps == 0
    finally:
        driver.stop()
        loop.close()


# -- config -------------------------------------------------------------------------------------------------
def test_config_from_env_and_flags():
    env = {"STOKER_FAKE_ENGINE": "1", "KAFKA_BOOTSTRAP_SERVERS": "k:1", "REDIS_URL": "redis://r:2/0",
           "STOKER_JOB_TOPIC": "jobs.x", "STOKER_PREFIX": "px", "STOKER_METRICS_PORT": "9500",
           "STOKER_MAX_NUM_SEQS": "8", "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SASL_MECHANISM": "PLAIN",
           "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p", "STOKER_MAX_POLL_RECORDS": "500",
           "STOKER_SWITCH_INTERVAL_S": "0.001"}
    cfg = parse_config(["--max-num-seqs", "4", "--group-id", "g"], env)
    assert cfg.fake_engine and cfg.bootstrap_servers == "k:1" and cfg.redis_url == "redis://r:2/0"
    assert cfg.names.jobs_topic == "jobs.x" and cfg.names.dlq_topic == "jobs.x.dlq" and cfg.prefix == "px"
    assert cfg.max_num_seqs == 4 and cfg.group_id == "g" and cfg.metrics_port == 9500  # flag beats env
    assert cfg.max_waiting == 4 and cfg.max_poll_records == 500 and cfg.switch_interval_s == 0.001
    assert cfg.kafka_security() == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
                                    "sasl_plain_username": "u", "sasl_plain_password": "p"}


def test_every_engine_setting_reaches_the_engine_config(tmp_path, monkeypatch):
    from stoker.worker.main import build_engine

    env = {"STOKER_MODEL": str(tmp_path), "STOKER_DEVICE": "cpu", "STOKER_DTYPE": "float16",
           "STOKER_BLOCK_SIZE": "32", "STOKER_NO_PREFIX_CACHING": "1", "STOKER_NO_TRITON": "yes",
           "STOKER_MAX_NUM_BATCHED_TOKENS": "2048", "STOKER_SEED": "7", "STOKER_GPU_MEMORY_UTILIZATION": "0.5"}
    cfg = parse_config(["--no-cuda-graphs", "--no-async-scheduling", "--no-blocking-sync", "--no-warmup",
                        "--num-kv-blocks", "64", "--max-num-batched-tokens", "1024"], env)
    monkeypatch.setattr("stoker.engine.LLMEngine", lambda config: config, raising=False)  # no model load here
    from stoker.engine.warmup import WarmupReport

    warmed: list[object] = []
    monkeypatch.setattr("stoker.engine.warm_up", lambda eng, **kw: warmed.append(eng) or WarmupReport(),
                        raising=False)
    ec = build_engine(cfg)
    assert warmed == []  # --no-warmup
    assert (ec.model_path, ec.device, ec.dtype, ec.block_size, ec.num_kv_blocks) == (str(tmp_path), "cpu", "float16",
                                                                                      32, 64)
    assert ec.max_num_batched_tokens == 1024 and ec.seed == 7 and ec.gpu_memory_utilization == 0.5  # flag beats env
    assert not ec.enable_prefix_caching and not ec.cuda_graphs and ec.async_scheduling is False
    assert not ec.use_triton and not ec.blocking_sync
    defaults = build_engine(parse_config([], {"STOKER_MODEL": str(tmp_path), "STOKER_DEVICE": "cpu"}))
    assert warmed == [defaults]  # warmed up before the worker serves, by default
    assert defaults.enable_prefix_caching and defaults.cuda_graphs and defaults.async_scheduling is None
    assert defaults.use_triton and defaults.blocking_sync and defaults.block_size == 16


def test_the_workers_engine_defaults_are_the_engines():
    """A worker started with no engine options builds the EngineConfig that EngineConfig's own defaults give: every
    setting it has an option for is passed explicitly (worker/main.engine_settings), from the option table's
    defaults or WorkerConfig's, so a default changed in one of the three places only (a measured engine default the
    worker kept at its old value) fails here."""
    import dataclasses

    from stoker.engine import EngineConfig
    from stoker.worker.main import engine_settings

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    # the option table's defaults (parse_config) and WorkerConfig's own (a WorkerConfig built in code)
    for cfg in (parse_config([], {"STOKER_MODEL": "/models/m"}), WorkerConfig(model="/models/m")):
        settings = engine_settings(cfg, None)
        assert settings.pop("model_path") == "/models/m"
        assert len(settings) >= 20, sorted(settings)
        assert {name: value for name, value in settings.items() if value != defaults[name]} == {}


def test_a_model_reloaded_in_the_same_process_gets_the_light_warm_up(tmp_path, monkeypatch):
    """The idle-unload reload path: the first build of a model warms it up in full, a later build of the same
    served name (its kernels compiled in this process) runs the light warm-up; another model its own full one."""
    from stoker.worker import main as worker_main
    from stoker.worker.model_specs import parse_model_option

    monkeypatch.setattr(worker_main, "_WARMED", set())
    monkeypatch.setattr("stoker.engine.LLMEngine", lambda config: config, raising=False)
    from stoker.engine.warmup import WarmupReport

    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr("stoker.engine.warm_up",
                        lambda eng, light=False: calls.append((eng.model_name, light)) or WarmupReport(), raising=False)
    cfg = parse_config(["--device", "cpu"], {"STOKER_MODEL": str(tmp_path)})
    a, b = parse_model_option(f"{tmp_path},name=a"), parse_model_option(f"{tmp_path},name=b")
    for spec in (a, a, b, a):
        worker_main._build_one(cfg, spec)
    assert calls == [("a", False), ("a", True), ("b", False), ("a", True)]


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "no model"),
    ({"fake_engine": True, "max_num_seqs": 0}, "max_num_seqs"),
    ({"fake_engine": True, "redis_url": "http://x"}, "redis_url"),
    ({"fake_engine": True, "claim_ttl_s": 0.1}, "claim_ttl_s"),
    ({"fake_engine": True, "security_protocol": "SASL_SSL"}, "sasl_mechanism"),
    ({"fake_engine": True, "job_topic": "bad topic"}, "jobs_topic"),
    ({"fake_engine": True, "switch_interval_s": 0}, "switch_interval_s"),
    ({"fake_engine": True, "max_tenant_labels": -1}, "max_tenant_labels"),
    ({"fake_engine": True, "block_size": 24}, "block_size must be a power of two"),
    ({"fake_engine": True, "dtype": "int8"}, "dtype"),
    ({"fake_engine": True, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"fake_engine": True, "step_stall_timeout_s": -1}, "step_stall_timeout_s"),
    ({"fake_engine": True, "model_load_timeout_s": -1}, "model_load_timeout_s"),
    ({"fake_engine": True, "fake_hang_after_steps": -1}, "fake_hang_after_steps"),
])
def test_config_rejects_bad_values_with_a_reason(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        WorkerConfig(**kwargs)


def test_bad_env_value_is_named(capsys):
    with pytest.raises(SystemExit):
        parse_config([], {"STOKER_FAKE_ENGINE": "1", "STOKER_MAX_NUM_SEQS": "many"})
    assert "STOKER_MAX_NUM_SEQS" in capsys.readouterr().err


def test_stream_cap_fits_the_longest_request_and_keeps_the_flag_as_a_floor():
    from stoker.worker.service import Worker

    small = Worker(WorkerConfig(fake_engine=True, stream_maxlen=50, max_attempts=3), FakeEngine(max_model_len=1000))
    assert small.stream_cap() == 3 * 1001 + 1  # 3 attempts of 1000 chunks + a terminal each, + the poison error
    big = Worker(WorkerConfig(fake_engine=True, stream_maxlen=50_000), FakeEngine(max_model_len=1000))
    assert big.stream_cap() == 50_000


def test_tenant_labels_are_capped_and_the_absent_tenant_has_its_own():
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", None, "b", "c", "a", "b", "d")] == ["a", "", "b", "other", "a", "b", "other"]
    assert TenantLabels(0)("a") == "other"


def test_settle_heap_freezes_the_startup_heap_and_widens_the_young_generation():
    """In a fresh interpreter (the test process keeps its own collector): what was made before serving is out
    of the collector's walks, and a step's burst of short-lived objects no longer sets off collections."""
    import subprocess
    import sys

    code = ("import gc, json; from stoker.worker.main import settle_heap; import stoker.worker.service\n"
            "from stoker.engine.heap import YOUNG_THRESHOLD\n"
            "before = len(gc.get_objects()); settle_heap(); after = len(gc.get_objects())\n"
            "runs = gc.get_stats()[0]['collections']\n"
            "burst = [[i] for i in range(YOUNG_THRESHOLD // 2)]\n"  # short-lived containers, as in a step
            "print(json.dumps([before, gc.get_freeze_count(), after, gc.get_threshold()[0],"
            " gc.get_stats()[0]['collections'] - runs]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    before, frozen, tracked, young, young_collections = json.loads(out.stdout)
    assert frozen >= before * 0.9 and tracked < before / 5
    assert young == 20_000 and young_collections == 0
