"""The admission order (worker/admission.py) alone: class, priority, tenant share, arrival; limits skipped;
the read-ahead pause rule; the parsers of the tenant options."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stoker.schemas import ChatMessage, Job
from stoker.worker.admission import (
    BATCH,
    LIVE,
    Backlog,
    Queued,
    TenantShares,
    estimate_tokens,
    parse_weights,
    paused_classes,
)
from stoker.worker.tenant_limits import TenantLimits, parse_limits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def backlog(weights: dict[str, float] | None = None, batch_weight: float = 0.0, clock: Clock | None = None,
            half_life_s: float = 60.0) -> Backlog[str]:
    return Backlog(TenantShares(weights, half_life_s, clock or Clock()), batch_weight)


def q(name: str, tenant: str = "a", priority: int = 0, job_class: int = LIVE, cost: int = 10,
      size: int = 100) -> Queued[str]:
    return Queued(name, job_class, priority, tenant, size, cost)


def drain(b: Backlog[str], blocked: frozenset[str] = frozenset()) -> list[str]:
    out = []
    while (item := b.pop(blocked)) is not None:
        out.append(item.item)
    return out


def test_a_tenant_behind_a_burst_is_admitted_at_once_then_shares_alternate():
    b = backlog()
    for i in range(1000):
        b.add(q(f"a{i}", "a"))
    for i in range(5):
        b.add(q(f"b{i}", "b"))
    first = [b.pop().item for _ in range(10)]  # type: ignore[union-attr]
    # a0 goes first (both at zero, a arrived first), then the tenants alternate by their charged tokens
    assert first == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]


def test_tenant_weights_split_admissions_in_proportion():
    b = backlog({"big": 4.0})
    for i in range(500):
        b.add(q(f"big{i}", "big"))
        b.add(q(f"small{i}", "small"))
    got = Counter(b.pop().tenant for _ in range(250))  # type: ignore[union-attr]
    assert got["big"] == 200 and got["small"] == 50


def test_jobs_that_cost_more_count_more():
    b = backlog()
    for i in range(100):
        b.add(q(f"long{i}", "long", cost=100))
        b.add(q(f"short{i}", "short", cost=10))
    got = Counter(b.pop().tenant for _ in range(55))  # type: ignore[union-attr]
    assert got["short"] == 50 and got["long"] == 5  # equal tokens, not equal jobs


def test_class_then_priority_before_tenant_share():
    b = backlog()
    b.add(q("batch-urgent", "x", priority=-100, job_class=BATCH))
    b.add(q("live-low", "y", priority=5))
    b.add(q("live-high", "y", priority=-1))
    b.add(q("live-mid", "z", priority=0))
    assert drain(b) == ["live-high", "live-mid", "live-low", "batch-urgent"]


def test_batch_weight_gives_the_batch_class_its_share_while_live_waits():
    b = backlog(batch_weight=0.25)
    for i in range(200):
        b.add(q(f"l{i}", job_class=LIVE))
        b.add(q(f"b{i}", job_class=BATCH))
    got = Counter(b.pop().job_class for _ in range(100))  # type: ignore[union-attr]
    assert got[LIVE] == 80 and got[BATCH] == 20


def test_batch_weight_zero_is_strict_and_an_idle_class_banks_no_credit():
    strict = backlog()
    for i in range(50):
        strict.add(q(f"b{i}", job_class=BATCH))
        strict.add(q(f"l{i}", job_class=LIVE))
    assert [strict.pop().job_class for _ in range(50)] == [LIVE] * 50  # type: ignore[union-attr]
    b = backlog(batch_weight=1.0)
    for i in range(100):
        b.add(q(f"b{i}", job_class=BATCH))
    drain_some = [b.pop() for _ in range(50)]  # batch alone: no credit is owed to live for this
    assert all(x is not None for x in drain_some)
    for i in range(10):
        b.add(q(f"l{i}", job_class=LIVE))
    got = [b.pop().job_class for _ in range(10)]  # type: ignore[union-attr]
    assert got.count(LIVE) == 5  # 1:1 from here, not 10 live in a row


def test_blocked_tenants_are_skipped_and_keep_their_place():
    b = backlog()
    for i in range(3):
        b.add(q(f"a{i}", "a"))
        b.add(q(f"b{i}", "b", priority=1))
    assert drain(b, frozenset({"a"})) == ["b0", "b1", "b2"]  # a lower priority goes while the higher is blocked
    assert drain(b) == ["a0", "a1", "a2"]


def test_put_back_restores_order_and_charge():
    b = backlog()
    for name, tenant in (("a0", "a"), ("b0", "b"), ("a1", "a")):
        b.add(q(name, tenant))
    first = b.pop()
    assert first is not None and first.item == "a0"
    b.put_back(first)
    assert drain(b) == ["a0", "b0", "a1"]
    assert len(b) == 0 and b.bytes == 0 and b.jobs_by_tenant == {}


def test_shares_decay_with_the_half_life():
    clock = Clock()
    shares = TenantShares({"w": 2.0}, half_life_s=10.0, clock=clock)
    shares.charge("a", 1000)
    shares.charge("w", 1000)
    clock.now += 10
    assert shares.share("a") == pytest.approx(500) and shares.share("w") == pytest.approx(250)
    clock.now += 10 * 600  # past the rebase point: values stay right and comparable
    shares.charge("b", 1)
    assert shares.rebases == 1 and shares.share("b") == pytest.approx(1) and shares.share("a") == 0


def test_a_burst_long_past_no_longer_counts():
    clock = Clock()
    b = backlog(clock=clock, half_life_s=1.0)
    b.charge("a", 1_000_000)
    b.add(q("a0", "a"))
    b.add(q("b0", "b"))
    assert b.pop().item == "b0"  # type: ignore[union-attr]
    b.put_back(q("b0", "b"))
    clock.now += 60  # sixty half-lives: a's million tokens weigh less than one job
    b.charge("b", 5)
    assert b.pop().item == "a0"  # type: ignore[union-attr]


def test_remove_if_drops_and_keeps_the_rest_in_order():
    b = backlog()
    for i in range(10):
        b.add(q(f"x{i}", "a" if i % 2 else "b", size=10 * i))
    dropped = b.remove_if(lambda item: item.item in ("x3", "x4"))
    assert sorted(d.item for d in dropped) == ["x3", "x4"]
    assert b.bytes == sum(10 * i for i in range(10)) - 70
    assert drain(b) == ["x0", "x1", "x2", "x5", "x6", "x7", "x8", "x9"]


jobs_strategy = st.lists(st.tuples(st.sampled_from([LIVE, BATCH]), st.integers(-2, 2), st.sampled_from("abcd"),
                                   st.integers(1, 50)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(jobs=jobs_strategy, blocked=st.frozensets(st.sampled_from("abcd"), max_size=2),
       weights=st.dictionaries(st.sampled_from("abcd"), st.floats(0.1, 10), max_size=4))
def test_every_pop_is_the_least_by_class_priority_share_arrival(jobs, blocked, weights):
    b = backlog(weights)
    for i, (job_class, priority, tenant, cost) in enumerate(jobs):
        b.add(q(f"j{i}", tenant, priority, job_class, cost))
    waiting = {f"j{i}": (job_class, priority, tenant, i) for i, (job_class, priority, tenant, _) in enumerate(jobs)}
    popped = []
    while (got := b.pop(blocked)) is not None:
        eligible = [v for v in waiting.values() if v[2] not in blocked]
        job_class, priority, tenant, arrival = waiting.pop(got.item)
        assert (job_class, priority) == min((c, p) for c, p, _, _ in eligible)
        level = [v for v in eligible if (v[0], v[1]) == (job_class, priority)]
        # the tenant's earliest job at this level, and no tenant at this level had a smaller share before
        assert arrival == min(v[3] for v in level if v[2] == tenant)
        popped.append(got)
    assert all(v[2] in blocked for v in waiting.values())
    assert len(b) == len(waiting) and sum(b.jobs_by_tenant.values()) == len(waiting)


@settings(max_examples=100, deadline=None)
@given(jobs=jobs_strategy)
def test_the_tenant_chosen_had_the_least_share_at_its_level(jobs):
    b = backlog()
    for i, (job_class, priority, tenant, cost) in enumerate(jobs):
        b.add(q(f"j{i}", tenant, priority, job_class, cost))
    level_of = {f"j{i}": (c, p, t) for i, (c, p, t, _) in enumerate(jobs)}
    remaining = dict(level_of)
    while True:
        keys_before = {t: b.shares.key(t) for t in "abcd"}
        got = b.pop()
        if got is None:
            break
        c, p, t = remaining.pop(got.item)
        rivals = {rt for rc, rp, rt in remaining.values() if (rc, rp) == (c, p)} | {t}
        assert keys_before[t] == min(keys_before[r] for r in rivals)
    assert not remaining


def test_backlog_entry_memory_stays_under_the_workers_estimate():
    """The worker counts a queued job as twice its record plus QUEUED_OVERHEAD_BYTES; measure a real entry
    (decoded Job, request entry, queue slot) to keep that estimate honest."""
    import msgspec
    from stoker.schemas import decode_job
    from stoker.worker.admitter import QUEUED_OVERHEAD_BYTES
    from stoker.worker.requests import Request, RequestState, RequestTable

    raws = [msgspec.json.encode({"type": "job", "request_id": f"req-{i:08d}", "prompt": f"tell me a story {i}",
                                 "max_tokens": 16, "tenant": f"tenant-{i % 50}"}) for i in range(5000)]
    b = backlog()
    table = RequestTable()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, raw in enumerate(raws):
        job = decode_job(raw, None)
        entry = Request(job, False, 0.0, [(("topic", 0), i)], (job.request_id.encode(), raw, []))
        table.put(entry, RequestState.QUEUED)
        b.add(Queued(entry, LIVE, job.priority, job.tenant or "", 2 * len(raw), estimate_tokens(job)))  # type: ignore[arg-type]
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(raws)
    tracemalloc.stop()
    record = sum(len(r) for r in raws) / len(raws)
    assert per_entry < 2 * record + QUEUED_OVERHEAD_BYTES, (per_entry, record)


def test_pause_rule_keeps_room_for_live_and_does_not_flap():
    mib = 1 << 20
    assert paused_classes([0, 75 * mib], 100 * mib, 0.75, set()) == {BATCH}
    assert paused_classes([10 * mib, 70 * mib], 100 * mib, 0.75, set()) == set()
    assert paused_classes([30 * mib, 70 * mib], 100 * mib, 0.75, set()) == {LIVE, BATCH}
    # paused at 75, resumed only below 90% of it
    assert paused_classes([0, 70 * mib], 100 * mib, 0.75, {BATCH}) == {BATCH}
    assert paused_classes([0, 67 * mib], 100 * mib, 0.75, {BATCH}) == set()


def test_estimate_tokens_counts_prompt_and_max_tokens():
    assert estimate_tokens(Job(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=7)) == 10
    assert estimate_tokens(Job(request_id="r", prompt="x" * 40, max_tokens=1)) == 12
    assert estimate_tokens(Job(request_id="r", messages=[ChatMessage(role="user", content="hi")], max_tokens=2)) == 6


@pytest.mark.parametrize("spec", ["acme", "acme=", "=4", "acme=0", "acme=-1", "acme=x", "acme=inf"])
def test_bad_tenant_weight_is_named(spec):
    with pytest.raises(ValueError, match=f"TENANT=NUMBER.*{spec!r}".replace("[", r"\[")):
        parse_weights([spec], "tenant_weight")


@pytest.mark.parametrize("spec", ["acme", "acme=0", "acme=1.5", "=3", "acme=-2"])
def test_bad_tenant_limit_is_named(spec):
    with pytest.raises(ValueError, match="TENANT=N with a whole number"):
        parse_limits([spec], "tenant_max_running")


def test_limits_of_a_tenant_fall_back_to_star_and_never_apply_without_tenant():
    limits = TenantLimits(parse_limits(["acme=2", "*=5"], "x"), parse_limits(["acme=600"], "y"), burst_s=6)
    assert limits.of("acme") == (2, 600)
    assert limits.of("other") == (5, -1)
    assert limits.of(None) == (-1, -1)
    assert limits.capacity(600) == 60
    assert parse_weights(["a=b=2"], "w") == {"a=b": 2.0}  # the last '=' splits: tenants may hold '='


@pytest.mark.parametrize("kwargs, named", [
    ({"batch_weight": -0.5}, "batch_weight"),
    ({"max_backlog_bytes": 1000}, "max_backlog_bytes"),
    ({"batch_backlog_share": 0.0}, "batch_backlog_share"),
    ({"tenant_share_half_life_s": 0.0}, "tenant_share_half_life_s"),
    ({"tenant_burst_s": -1.0}, "tenant_burst_s"),
    ({"tenant_weight": ("acme",)}, "tenant_weight takes TENANT=NUMBER"),
    ({"tenant_max_running": ("acme=0",)}, "tenant_max_running takes TENANT=N"),
    ({"tenant_tokens_per_minute": ("acme=lots",)}, "tenant_tokens_per_minute takes TENANT=N"),
    ({"batch_topic": "bad topic"}, "batch_topic must be 1-249 chars"),
    ({"batch_topic": "stoker.jobs"}, "batch_topic must differ"),
    ({"batch_topic": "x.batch", "no_batch_topic": True}, "contradict"),
])
def test_worker_config_names_each_bad_tenancy_setting(kwargs, named):
    from stoker.worker.config import WorkerConfig

    with pytest.raises(ValueError, match=named):
        WorkerConfig(fake_engine=True, **kwargs)


def test_worker_flags_and_env_give_the_batch_topic_weights_and_limits():
    from stoker.worker.main import parse_config

    cfg = parse_config(["--fake-engine", "--tenant-weight", "acme=4", "--tenant-weight", "b=0.5",
                        "--job-topic", "j"], env={"STOKER_TENANT_TOKENS_PER_MINUTE": "acme=600 *=60"})
    assert cfg.tenant_weights() == {"acme": 4.0, "b": 0.5}
    assert cfg.tenant_limits().of("zed") == (-1, 60) and cfg.batch_topic_name == "j.batch"
    assert parse_config(["--fake-engine", "--no-batch-topic"], env={}).batch_topic_name is None


def test_the_backlog_keeps_no_garbage_across_many_empty_and_refill_cycles():
    clock = Clock()
    b = backlog(clock=clock, half_life_s=1.0)
    for cycle in range(2000):
        b.add(q(f"x{cycle}", f"tenant-{cycle}", priority=cycle % 3))
        assert b.pop() is not None
        clock.now += 1
    assert len(b) == 0 and all(len(h) <= 3 for h in b._priorities)  # noqa: SLF001 -- the leak it guards
    assert len(b.shares.version) < 1000  # tenants long idle are forgotten at a rebase


def lane_q(name: str, lane: str, tenant: str = "a") -> Queued[str]:
    return Queued(name, LIVE, 0, tenant, 100, 10, lane=lane)


def test_a_full_lane_is_skipped_and_a_tenants_order_across_lanes_is_kept():
    """A model whose engine is full (its lane) holds back none of the jobs behind its own: they are popped
    past it, in order; with no lane full a tenant's jobs still come in arrival order across models."""
    b = backlog()
    for i in range(50):
        b.add(lane_q(f"busy{i}", "busy"))
    b.add(lane_q("idle0", "idle"))
    b.add(lane_q("idle1", "idle", tenant="t2"))
    assert [b.pop(full_lanes={"busy"}).item for _ in range(2)] == ["idle0", "idle1"]  # type: ignore[union-attr]
    assert b.pop(full_lanes={"busy"}) is None and len(b) == 50
    assert drain(b) == [f"busy{i}" for i in range(50)]
    mixed = backlog()
    for i in range(6):
        mixed.add(lane_q(f"j{i}", "m1" if i % 2 else "m2"))
    assert drain(mixed) == [f"j{i}" for i in range(6)]


def test_model_room_is_per_model_slots_and_per_model_kv():
    """Each model's room is its own: slots less its own held jobs, and zero only when its OWN KV cache is
    short with requests waiting (summing free blocks over models let a full model take more)."""
    from stoker.engine import EngineStats
    from stoker.worker.admitter import model_room

    def stats(free: int, total: int, waiting: int) -> EngineStats:
        zero = {name: 0 for name in EngineStats.__dataclass_fields__}
        return EngineStats(**(zero | {"kv_blocks_free": free, "kv_blocks_total": total, "num_waiting": waiting}))

    room = model_room(8, {"a": 3, "b": 8, "gone": 2},
                      {"a": stats(90, 100, 0), "b": stats(100, 100, 0), "short": stats(1, 100, 2), "new": None}, 0.05)
    assert room == {"a": 5, "b": 0, "short": 0, "new": 8}
    assert model_room(8, {}, {"short": stats(1, 100, 0)}, 0.05) == {"short": 8}  # nothing waits in it: room
