"""ModelSet (worker/models.py) with the stand-in engine: routing by model, turn-taking, idle unload and reload
on demand, and the --model / --models-file configuration. No model, no Kafka: the worker's real-stack test
with two real models is tests/test_worker_models.py."""

from __future__ import annotations

import threading
import time

import pytest
from stoker.engine import EngineRequest, EngineRequestError, SamplingParams
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.main import parse_config
from stoker.worker.model_specs import MEMORY_SHARE_MARGIN, ModelSpec, parse_model_option
from stoker.worker.models import ModelSet


class CountingEngine(FakeEngine):
    """A FakeEngine that records each of its steps in a log shared by the set's engines (the turn order)."""

    def __init__(self, name: str, log: list[str], **kw: object):
        super().__init__(name, **kw)  # type: ignore[arg-type]
        self.log = log
        self.closed = False

    def step(self):  # noqa: ANN201 -- FakeEngine's
        self.log.append(self.model_name)
        return super().step()

    def close(self) -> None:
        self.closed = True


def request(rid: str, model: str | None = None, max_tokens: int = 3, prompt: str = "hello there") -> EngineRequest:
    return EngineRequest(rid, prompt=prompt, params=SamplingParams(max_tokens=max_tokens), model=model)


def drain(models: ModelSet, limit: int = 1000) -> dict[str, list]:
    """Step until nothing is left; every request's outputs, by id."""
    seen: dict[str, list] = {}
    for _ in range(limit):
        if not models.has_unfinished():
            return seen
        for out in models.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("the set never ran dry")


def make_set(names: list[str], log: list[str], **kw: object) -> tuple[ModelSet, dict[str, list[CountingEngine]]]:
    built: dict[str, list[CountingEngine]] = {}

    def load(name: str) -> CountingEngine:
        engine = CountingEngine(name, log)
        built.setdefault(name, []).append(engine)
        return engine

    return ModelSet(names, load, **kw), built  # type: ignore[arg-type]


def test_requests_go_to_their_model_and_the_first_is_the_default():
    log: list[str] = []
    models, built = make_set(["a", "b"], log)
    assert models.model_names == ["a", "b"] and models.model_name == "a"
    models.add_request(request("r-b", "b"))
    models.add_request(request("r-none"))
    models.add_request(request("r-a", "a"))
    with pytest.raises(EngineRequestError) as err:
        models.add_request(request("r-c", "c"))
    assert err.value.code == "unknown_model" and "'c'" in err.value.message and "['a', 'b']" in err.value.message
    outputs = drain(models)
    assert set(outputs) == {"r-a", "r-b", "r-none"}
    # each engine saw only its own requests: the stand-in's tokens depend on the id only, so check the counts
    assert built["a"][0].stats().prompt_tokens_total == 2 * 2 and built["b"][0].stats().prompt_tokens_total == 2
    assert all(outs[-1].finished and outs[-1].completion_tokens == 3 for outs in outputs.values())


def test_busy_models_take_turns_and_an_idle_one_is_never_stepped():
    log: list[str] = []
    models, _ = make_set(["a", "b", "c"], log)
    models.add_request(request("a1", "a", max_tokens=6))
    models.add_request(request("b1", "b", max_tokens=3))
    drain(models)
    # alternate while both have work (one engine step per set step), then a alone; c never
    assert log[:6] == ["a", "b"] * 3, log
    assert set(log[6:]) == {"a"} and "c" not in log


def test_abort_reaches_the_model_that_runs_the_request():
    log: list[str] = []
    models, _ = make_set(["a", "b"], log)
    models.add_request(request("b1", "b", max_tokens=50))
    models.step()
    models.abort("b1")
    models.abort("never-seen")  # unknown ids are a no-op
    outputs = drain(models)
    assert outputs["b1"][-1].finished and outputs["b1"][-1].finish_reason == "cancelled"


def test_stats_are_the_sum_and_each_models_own():
    log: list[str] = []
    models, _ = make_set(["a", "b"], log)
    models.add_request(request("a1", "a", max_tokens=4))
    models.add_request(request("b1", "b", max_tokens=2))
    models.add_request(request("b2", "b", max_tokens=2))
    drain(models)
    total = models.stats()
    per = models.last_model_stats
    assert per["a"].generation_tokens_total == 4 and per["b"].generation_tokens_total == 4
    assert total.generation_tokens_total == 8 and total.kv_blocks_total == 2 * 16384


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wait_for(predicate, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_an_idle_model_unloads_and_a_job_reloads_it_while_the_other_keeps_stepping():
    log: list[str] = []
    clock = Clock()
    gate = threading.Event()  # holds the reload until the test lets it finish
    built: dict[str, list[CountingEngine]] = {}

    def load(name: str) -> CountingEngine:
        if built.get(name):  # a reload, not the startup load
            assert gate.wait(10)
        engine = CountingEngine(name, log)
        built.setdefault(name, []).append(engine)
        return engine

    models = ModelSet(["a", "b"], load, idle_unload_s=30, clock=clock)  # type: ignore[arg-type]
    woken = threading.Event()
    models.set_waker(woken.set)
    models.add_request(request("a1", "a"))
    drain(models)
    assert not models.has_unfinished()
    clock.now += 31  # both idle past the limit
    assert models.has_unfinished()  # an unload is due: the driver must step
    models.step()
    assert models.model_state("a") == "unloaded" and models.model_state("b") == "unloaded"
    assert built["a"][0].closed and built["b"][0].closed
    # a loaded model is not unloaded while it has work, nor right after a job
    models2, built2 = make_set(["x"], [], idle_unload_s=30, clock=clock)
    models2.add_request(request("x1", "x", max_tokens=2))
    clock.now += 100
    models2.step()
    assert models2.model_state("x") == "loaded" and not built2["x"][0].closed
    # reload on demand: b's job waits while b loads, a (reloaded first, at once) keeps stepping meanwhile
    gate.set()
    models.add_request(request("a2", "a", max_tokens=2))
    wait_for(lambda: models.model_state("a") == "loaded")
    gate.clear()
    models.add_request(request("b1", "b", max_tokens=2))
    assert models.model_state("b") == "loading"
    models.add_request(request("a3", "a", max_tokens=4))
    outputs = drain(models)
    assert set(outputs) == {"a2", "a3"} and models.model_state("b") == "loading"
    woken.clear()
    gate.set()
    wait_for(lambda: models.model_state("b") == "loaded")
    assert woken.is_set()  # the driver is told that b has work now
    outputs = drain(models)
    assert outputs["b1"][-1].finished and outputs["b1"][-1].completion_tokens == 2
    assert len(built["b"]) == 2 and log[-1] == "b"


def test_a_failed_reload_fails_the_waiting_jobs_and_the_next_job_tries_again():
    log: list[str] = []
    clock = Clock()
    attempts = {"n": 0}
    gate = threading.Event()  # holds the third load until both of its jobs wait for it

    def load(name: str) -> CountingEngine:
        attempts["n"] += 1
        if attempts["n"] == 2:
            raise OSError("model folder vanished")
        if attempts["n"] == 3:
            assert gate.wait(10)
        return CountingEngine(name, log, max_model_len=64)

    models = ModelSet(["a"], load, idle_unload_s=5, clock=clock)  # type: ignore[arg-type]
    clock.now += 6
    models.step()
    assert models.model_state("a") == "unloaded"
    models.add_request(request("w1", "a"))
    wait_for(lambda: models.model_state("a") == "failed")
    outputs = drain(models)
    assert outputs["w1"][-1].error_code == "internal" and "vanished" in outputs["w1"][-1].error_message
    # the next job reloads; one the new engine refuses (too long for its context) fails alone, by its code
    models.add_request(request("w2", "a", max_tokens=2))
    models.add_request(request("w3", "a", max_tokens=100))
    gate.set()
    wait_for(lambda: models.model_state("a") == "loaded")
    outputs = drain(models)
    assert outputs["w2"][-1].finished and outputs["w2"][-1].error_code is None
    assert outputs["w3"][-1].error_code == "context_length_exceeded"


def test_totals_survive_an_unload():
    clock = Clock()
    models, _ = make_set(["a"], [], idle_unload_s=5, clock=clock)
    models.add_request(request("a1", "a", max_tokens=3))
    drain(models)
    clock.now += 6
    models.step()
    assert models.model_state("a") == "unloaded"
    assert models.stats().generation_tokens_total == 3  # counters never go back when a model unloads


# -- configuration -------------------------------------------------------------------------------------------
def test_model_option_syntax():
    assert parse_model_option("/m/llama") == ModelSpec("/m/llama")
    spec = parse_model_option("/m/llama,name=chat,memory=0.45,kv-cache-memory-bytes=1024")
    assert spec == ModelSpec("/m/llama", "chat", 0.45, 1024) and spec.served_name == "chat"
    assert ModelSpec("/m/llama/").served_name == "llama"
    for bad, needle in [("/m/x,size=3", "not one of"), ("/m/x,memory=1.5", r"memory=1.5 must be"),
                        ("/m/x,memory=lots", "must be a number"), (",name=x", "path")]:
        with pytest.raises(ValueError, match=needle):
            parse_model_option(bad)


def test_several_models_from_flags_env_and_file(tmp_path):
    env = {"STOKER_FAKE_ENGINE": "1"}
    single = parse_config(["--model", "/m/one"], env)
    assert single.model == "/m/one" and single.models == ()  # the form of old, unchanged
    cfg = parse_config(["--model", "/m/a,name=a,memory=0.4", "--model", "/m/b,memory=0.4"], env)
    assert [s.served_name for s in cfg.models] == ["a", "b"] and cfg.model == "/m/a"
    from_env = parse_config([], env | {"STOKER_MODEL": "/m/my models/a;/m/b"})
    assert [s.path for s in from_env.models] == ["/m/my models/a", "/m/b"]
    file = tmp_path / "models.toml"
    file.write_text('[[model]]\npath = "/m/c"\nname = "c"\nmemory = 0.3\n\n[[model]]\npath = "d"\nmemory = 0.3\n')
    both = parse_config(["--model", "/m/a,memory=0.3", "--models-file", str(file), "--model-idle-unload-s", "60"], env)
    assert [s.served_name for s in both.models] == ["a", "c", "d"] and both.model_idle_unload_s == 60
    assert both.models[2].path == str(tmp_path / "d")  # relative to the file
    assert [s.memory for s in both.models] == [0.3, 0.3, 0.3]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "/m/a,memory=0.5", "--model", "/m/b,memory=0.5"], f"over {1 - MEMORY_SHARE_MARGIN:.2f}"),
    (["--model", "/x/m", "--model", "/y/m"], "served model names must differ"),
    (["--model", "/m/a,memory=0.4", "--model", "/m/b"], "every model a memory= share or none"),
    (["--model", "/m/a", "--model", "/m/b", "--served-model-name", "z"], "give each a name="),
    (["--models-file", "/no/such.toml"], "cannot be read"),
    (["--model", "/m/a", "--model-idle-unload-s", "0"], "model_idle_unload_s must be > 0"),
    (["--model", "/m/a,memory=0.4", "--model", "/m/b,memory=0.4", "--tensor-parallel", "2"],
     "--tensor-parallel 2 serves one model per worker, got 2 models: run one worker per model"),
])
def test_bad_model_sets_are_refused_with_a_reason(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv, {"STOKER_FAKE_ENGINE": "1"})
    assert needle in capsys.readouterr().err


def test_build_engine_makes_a_set_of_stand_ins_for_several_models():
    from stoker.worker.main import build_engine

    cfg = parse_config(["--model", "/m/a,name=a", "--model", "/m/b,name=b"], {"STOKER_FAKE_ENGINE": "1"})
    engine = build_engine(cfg)
    assert isinstance(engine, ModelSet) and engine.model_names == ["a", "b"]
    single = build_engine(parse_config([], {"STOKER_FAKE_ENGINE": "1"}))
    assert isinstance(single, FakeEngine)  # one model: no set in between


def test_a_job_cancelled_while_its_model_loads_ends_cancelled_once_loaded():
    clock = Clock()
    gate = threading.Event()
    loads = {"n": 0}

    def load(name: str) -> CountingEngine:
        loads["n"] += 1
        if loads["n"] > 1:
            assert gate.wait(10)
        return CountingEngine(name, [])

    models = ModelSet(["a"], load, idle_unload_s=5, clock=clock)  # type: ignore[arg-type]
    clock.now += 6
    models.step()
    models.add_request(request("c1", "a", max_tokens=50))
    models.add_request(request("c2", "a", max_tokens=2))
    models.abort("c1")  # held with the request, in order, while the model loads
    gate.set()
    wait_for(lambda: models.model_state("a") == "loaded")
    outputs = drain(models)
    assert outputs["c1"][-1].finish_reason == "cancelled" and outputs["c1"][-1].completion_tokens == 0
    assert outputs["c2"][-1].finish_reason == "length"


def test_a_model_is_not_unloaded_while_a_request_is_being_handed_to_it():
    clock = Clock()
    inside, release = threading.Event(), threading.Event()

    class SlowToTake(CountingEngine):
        def add_request(self, request: EngineRequest) -> None:
            inside.set()
            assert release.wait(10)
            super().add_request(request)

    models = ModelSet(["a"], lambda name: SlowToTake(name, []), idle_unload_s=5, clock=clock)  # type: ignore[arg-type]
    adder = threading.Thread(target=models.add_request, args=(request("s1", "a", max_tokens=2),))
    adder.start()
    assert inside.wait(10)
    clock.now += 6  # idle by the clock, but a request is on its way in
    models.step()
    assert models.model_state("a") == "loaded"
    release.set()
    adder.join(10)
    assert drain(models)["s1"][-1].finish_reason == "length"


def test_per_model_readiness_and_metrics():
    from prometheus_client.parser import text_string_to_metric_families
    from stoker.worker.metrics import HealthServer, WorkerMetrics
    from stoker.worker.models import model_states

    clock = Clock()
    gate = threading.Event()
    loads = {"n": 0}

    def load(name: str) -> CountingEngine:
        loads["n"] += 1
        if loads["n"] > 2:  # reloads wait for the gate
            assert gate.wait(10)
        return CountingEngine(name, [])

    models = ModelSet(["a", "b"], load, idle_unload_s=5, clock=clock)  # type: ignore[arg-type]
    metrics = WorkerMetrics(model_name="a")
    metrics.watch_models(lambda: model_states(models, "a", None))
    health = HealthServer(metrics, ready=lambda: True, healthy=lambda: True, model_state=models.model_state)
    models.add_request(request("a1", "a", max_tokens=5))
    models.add_request(request("a2", "a", max_tokens=5))
    models.step()
    models.stats()

    def sample(name: str, model: str) -> float:
        text = metrics.render().decode()
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == name and s.labels == {"model": model})

    assert sample("stoker_model_requests_running", "a") == 2 and sample("stoker_model_requests_running", "b") == 0
    assert sample("stoker_model_kv_cache_usage", "a") > 0 and sample("stoker_model_loaded", "b") == 1
    drain(models)
    clock.now += 6
    models.step()  # both idle out
    models.stats()
    assert sample("stoker_model_loaded", "b") == 0 and health._model_ready("b") == (200, b"unloaded\n", "text/plain")
    models.add_request(request("b1", "b"))
    assert health._model_ready("b")[0] == 503 and health._model_ready("b")[1] == b"loading\n"
    assert health._model_ready("zz")[0] == 404
    gate.set()
    wait_for(lambda: models.model_state("b") == "loaded")
    assert health._model_ready("b")[0] == 200 and sample("stoker_model_loaded", "b") == 1


def test_routing_entries_end_with_their_requests():
    models, _ = make_set(["a", "b"], [])
    for i in range(6):
        models.add_request(request(f"r{i}", "ab"[i % 2], max_tokens=1))
    with pytest.raises(EngineRequestError):
        models.add_request(request("long", "a", max_tokens=10_000))  # refused by the engine: not kept either
    drain(models)
    assert models._owner == {}  # noqa: SLF001 -- no entry outlives its request (a long-lived worker would leak)


def test_an_engine_loaded_after_close_is_closed_not_installed():
    """The worker stops (close) while a model reloads on demand: the engine the loader builds afterwards
    must be closed by the loader, or it would hold its memory (and a tensor-parallel engine its ranks) with
    nobody left to close it."""
    clock = Clock()
    gate = threading.Event()
    built: list[CountingEngine] = []

    def load(name: str) -> CountingEngine:
        if built:  # the reload
            assert gate.wait(10)
        built.append(CountingEngine(name, []))
        return built[-1]

    models = ModelSet(["a"], load, idle_unload_s=30, clock=clock)  # type: ignore[arg-type]
    clock.now += 31
    models.step()  # unloads a
    models.add_request(request("a1", "a"))  # reloads it on a loader thread, held at the gate
    assert models.model_state("a") == "loading"
    models.close()
    gate.set()
    wait_for(lambda: len(built) == 2 and built[1].closed)
    assert models.model_state("a") == "unloaded"


def test_a_request_past_its_deadline_while_its_model_loads_ends_deadline_without_waiting_for_the_load():
    """The contract ends a request past its deadline_ms "also if still queued": one held while its model
    reloads (a GPU load can take a minute) ends `deadline` within about a second, the load still running;
    one without a deadline waits for the load and runs."""
    clock = Clock()
    gate = threading.Event()
    built: list[CountingEngine] = []

    def load(name: str) -> CountingEngine:
        if built:
            assert gate.wait(20)
        built.append(CountingEngine(name, []))
        return built[-1]

    models = ModelSet(["a"], load, idle_unload_s=30, clock=clock)  # type: ignore[arg-type]
    woken = threading.Event()
    models.set_waker(woken.set)
    clock.now += 31
    models.step()  # unloads a
    late = request("late", "a")
    late.deadline_ms = time.time() * 1000 + 200
    models.add_request(late)
    models.add_request(request("patient", "a", max_tokens=2))
    assert models.model_state("a") == "loading"
    ended: list = []
    wait_for(lambda: bool(ended.extend(models.step()) or ended), timeout=5)
    assert [(o.request_id, o.finished, o.finish_reason) for o in ended] == [("late", True, "deadline")]
    assert woken.is_set() and models.model_state("a") == "loading"
    gate.set()
    wait_for(lambda: models.model_state("a") == "loaded")
    outputs = drain(models)
    assert set(outputs) == {"patient"} and outputs["patient"][-1].completion_tokens == 2
    models.close()


async def test_a_step_waiting_for_an_exclusive_load_is_not_stalled_but_a_load_past_its_limit_is():
    """On CUDA with graphs a reload holds the GPU and another model's step waits for it (exclusive_load). The
    worker's watchdog (EngineDriver.stalled) must not take that wait for a hung step: a large model from slow
    storage may load for minutes, and the worker would exit and, restarted, load and exit again. The load itself
    is timed against its own limit (model_load_timeout_s), also when no step waits for it."""
    import asyncio

    from stoker.worker.driver import EngineDriver, EngineStalled

    clock = Clock()
    gate = threading.Event()
    gate.set()
    built: dict[str, list[CountingEngine]] = {}

    def load(name: str) -> CountingEngine:
        if built.get(name):  # a reload, not the startup load
            assert gate.wait(20)
        built.setdefault(name, []).append(CountingEngine(name, []))
        return built[name][-1]

    models = ModelSet(["a", "b"], load, idle_unload_s=30, exclusive_load=True, clock=clock)  # type: ignore[arg-type]
    clock.now += 31
    models.step()  # both idle out
    models.add_request(request("a1", "a", max_tokens=3))
    wait_for(lambda: models.model_state("a") == "loaded")
    gate.clear()
    models.add_request(request("b1", "b", max_tokens=2))  # b's reload takes the GPU and blocks on the gate
    wait_for(lambda: models.step_watch()[1] is not None)
    finished: list[str] = []

    def sink(outputs, stats, step_ms):  # noqa: ANN001
        finished.extend(o.request_id for o in outputs if o.finished)
        driver.published()

    driver = EngineDriver(models, asyncio.get_running_loop(), sink)
    driver.start()
    try:
        for _ in range(200):  # the driver's step of a1 starts and waits for the GPU
            if driver.step_started is not None and models.step_watch()[0] is None:
                break
            await asyncio.sleep(0.01)
        assert driver.step_started is not None and models.step_watch()[0] is None
        await asyncio.sleep(0.4)
        assert driver.stalled(0.2) is None and driver.stalled(0.2, load_limit_s=30) is None
        assert driver.fatal is None and built["a"][-1].steps == 0
        gate.set()  # the load ends: a's step gets the GPU, then b runs too
        for _ in range(500):
            if {"a1", "b1"} <= set(finished):
                break
            await asyncio.sleep(0.01)
        assert {"a1", "b1"} <= set(finished) and driver.fatal is None
        assert models.step_watch()[1] is None
        # A load that never ends is declared stuck past its own limit, with no step waiting for it.
        clock.now += 31
        driver.notify()
        wait_for(lambda: models.model_state("b") == "unloaded")
        gate.clear()
        models.add_request(request("b2", "b", max_tokens=2))
        wait_for(lambda: models.step_watch()[1] is not None)
        await asyncio.sleep(0.3)
        assert driver.stalled(300, load_limit_s=30) is None
        stalled = driver.stalled(300, load_limit_s=0.2)
        assert isinstance(stalled, EngineStalled) and driver.fatal is stalled
        assert "model_load_timeout_s 0.2" in str(stalled)
    finally:
        gate.set()
        driver.stop()
        models.close()
