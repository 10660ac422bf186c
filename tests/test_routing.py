"""Routing by model, pure parts: the gateway's model -> topic map built from heartbeats, and the worker's
rules for its heartbeat and for refusing a group that serves another model set. No Kafka, no Redis."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import pytest
from stoker.client.client import WorkerInfo
from stoker.gateway.routing import RouteCache, build_routes
from stoker.worker.fake_engine import FakeEngine
from stoker.worker.membership import Beat, conflicts, heartbeat, parse_beat, refusal, served_model_names

DEFAULT = "stoker.jobs"


def info(worker_id: str, topic: str | None, group: str | None, *models: str) -> WorkerInfo:
    """A WorkerInfo as the client builds it from a heartbeat (None topic/group: an older worker's)."""
    beat: dict[str, object] = {"model": models[0] if models else None, "capacity": 8}
    if topic is not None:
        beat |= {"topic": topic, "group": group, "models": list(models)}
    return WorkerInfo.from_heartbeat(worker_id, beat)


def test_two_groups_on_two_topics_route_each_model_to_its_own_topic() -> None:
    table = build_routes([info("a1", "t.a", "g.a", "model-a"), info("a2", "t.a", "g.a", "model-a"),
                          info("b1", "t.b", "g.b", "model-b", "model-c")], DEFAULT)
    assert table.models == ["model-a", "model-b", "model-c"]
    assert {m: r.topic for m, r in table.routes.items()} == {"model-a": "t.a", "model-b": "t.b", "model-c": "t.b"}
    assert table.routes["model-a"].groups == ("g.a",) and table.routes["model-a"].workers == 2
    assert table.unroutable == {} and table.choices == {} and table.workers == 3


def test_a_topic_whose_readers_disagree_routes_only_what_all_of_them_serve() -> None:
    # The outside test's bug: two workers with different models on one topic. Neither model is routable
    # there (a job may land on either worker), so neither is listed; a model every reader serves still is.
    table = build_routes([info("w1", "shared", "g", "x", "common"), info("w2", "shared", "g2", "y", "common")],
                         DEFAULT)
    assert table.models == ["common"]
    assert set(table.unroutable) == {"x", "y"}
    assert "w2 (common, y)" in table.unroutable["x"] and "'shared'" in table.unroutable["x"]
    assert table.not_routable("x") == f"model 'x' is not served by any live worker that can take it " \
                                      f"({table.unroutable['x']}); served: common"
    assert table.not_routable("nope") == "model 'nope' is not served by any live worker; served: common"


def test_a_model_unroutable_on_one_topic_is_still_routed_where_all_readers_serve_it() -> None:
    table = build_routes([info("w1", "mixed", "g1", "x"), info("w2", "mixed", "g2", "y"),
                          info("w3", "clean", "g3", "x")], DEFAULT)
    assert table.routes["x"].topic == "clean" and "x" not in table.unroutable
    assert table.models == ["x"] and set(table.unroutable) == {"y"}


def test_a_model_of_two_groups_goes_to_the_same_topic_whatever_the_heartbeat_order() -> None:
    workers = [info("z1", "t.zeta", "g.z", "shared", "z-only"), info("a1", "t.alpha", "g.a", "shared"),
               info("m1", "t.mu", "g.m", "shared")]
    picks = {build_routes(list(order), DEFAULT).routes["shared"].topic for order in itertools.permutations(workers)}
    assert picks == {"t.alpha"}
    table = build_routes(workers, DEFAULT)
    assert table.choices == {"shared": ("t.alpha", "t.mu", "t.zeta")}
    assert table.routes["z-only"].topic == "t.zeta"


def test_an_older_heartbeat_without_topic_is_taken_to_read_the_gateways_topic() -> None:
    table = build_routes([info("old", None, None, "legacy"), info("new", "t.n", "g.n", "fresh")], DEFAULT)
    assert {m: r.topic for m, r in table.routes.items()} == {"legacy": DEFAULT, "fresh": "t.n"}
    # ... and an older worker on the gateway's topic beside a new one with another model spoils both
    table = build_routes([info("old", None, None, "legacy"), info("new", DEFAULT, "g", "fresh")], DEFAULT)
    assert table.models == [] and set(table.unroutable) == {"legacy", "fresh"}


def test_no_workers_no_routes() -> None:
    table = build_routes([], DEFAULT)
    assert table.models == [] and table.workers == 0


def test_heartbeat_fields_odd_values_count_as_absent() -> None:
    w = WorkerInfo.from_heartbeat("w", {"model": "m", "topic": 7, "group": ["g"], "models": "not a list"})
    assert (w.topic, w.group, w.models) == (None, None, ("m",))  # `models` absent: the one `model`
    w = WorkerInfo.from_heartbeat("w", {"model": "m"})
    assert w.models == ("m",)
    w = WorkerInfo.from_heartbeat("w", {"models": ["b", "a", "b", 3]})
    assert w.models == ("a", "b")


async def test_route_cache_refreshes_after_max_age_only_and_logs_a_choice_once(
        caplog: pytest.LogCaptureFixture) -> None:
    fetched: list[int] = []
    fleet = [info("a1", "t.a", "g.a", "m"), info("b1", "t.b", "g.b", "m")]

    async def fetch() -> list[WorkerInfo]:
        fetched.append(1)
        return fleet

    cache = RouteCache(fetch, DEFAULT, max_age_s=0.0)
    with caplog.at_level(logging.WARNING, logger="stoker.gateway.routing"):
        for _ in range(3):
            assert (await cache.table()).routes["m"].topic == "t.a"
    assert len(fetched) == 3  # max age 0: every call re-reads
    assert [r.message for r in caplog.records].count(
        "event=model_on_several_topics model=m topics=t.a,t.b picked=t.a") == 1
    slow = RouteCache(fetch, DEFAULT, max_age_s=60.0)
    for _ in range(3):
        await slow.table()
    assert len(fetched) == 4


async def test_route_cache_a_burst_on_a_stale_table_waits_for_one_refresh() -> None:
    fetched: list[int] = []

    async def slow_fetch() -> list[WorkerInfo]:
        fetched.append(1)
        await asyncio.sleep(0.05)
        return [info("a1", "t.a", "g.a", "m")]

    cache = RouteCache(slow_fetch, DEFAULT, max_age_s=60.0)
    tables = await asyncio.gather(*(cache.table() for _ in range(20)))
    assert len(fetched) == 1 and all(t.routes["m"].topic == "t.a" for t in tables)


# ---- the worker's side -------------------------------------------------------------------------------


class TwoModels(FakeEngine):
    """The accessor a multi-model engine (ModelSet) offers: `model_names`."""

    def __init__(self, *names: str):
        super().__init__("unused")
        self.model_names = list(names)


def test_served_model_names_reads_model_names_else_the_one_model_name() -> None:
    assert served_model_names(TwoModels("b", "a")) == ["a", "b"]
    assert served_model_names(FakeEngine("solo")) == ["solo"]
    assert served_model_names(FakeEngine("solo"), "renamed") == ["renamed"]
    assert served_model_names(TwoModels("b", "a"), "renamed") == ["a", "b"]  # names come from the model set


def test_heartbeat_round_trip_and_older_heartbeats() -> None:
    raw = heartbeat("w1", "t", "g", ["a", "b"], capacity=4, running=1, version="0.1.0", started_at=1.0)
    body = json.loads(raw)
    assert (body["topic"], body["group"], body["models"], body["model"]) == ("t", "g", ["a", "b"], "a")
    assert (body["capacity"], body["running"]) == (4, 1)
    assert parse_beat("w1", raw) == Beat("w1", "t", "g", ("a", "b"), "")  # "": reads no batch topic
    custom = heartbeat("w1", "t", "g", ["a"], capacity=1, running=0, version="v", started_at=0.0, batch_topic="t.bulk")
    assert json.loads(custom)["batch_topic"] == "t.bulk" and parse_beat("w1", custom).batch_topic == "t.bulk"
    assert parse_beat("old", b'{"model": "m", "capacity": 1}') == Beat("old", None, None, ("m",))
    assert parse_beat("x", b"not json") is None and parse_beat("x", b"[1]") is None


def test_conflicts_same_set_in_another_order_is_the_same_set() -> None:
    beats = [Beat("w1", "t", "g", ("a", "b"))]
    assert conflicts("me", "t", "g", ["b", "a"], beats) == []
    assert conflicts("me", "t", "g", ["a"], beats) == beats


def test_conflicts_by_group_or_by_topic_but_not_elsewhere_nor_with_ourselves() -> None:
    same_group_other_topic = Beat("w1", "t.other", "g", ("x",))
    same_topic_other_group = Beat("w2", "t", "g.other", ("x",))
    elsewhere = Beat("w3", "t.3", "g.3", ("x",))
    older = Beat("w4", None, None, ("x",))  # can't be placed: not a conflict
    ourselves = Beat("me", "t", "g", ("x",))  # a restart that kept --worker-id
    beats = [same_group_other_topic, same_topic_other_group, elsewhere, older, ourselves]
    assert conflicts("me", "t", "g", ["a"], beats) == [same_group_other_topic, same_topic_other_group]


def test_refusal_names_the_workers_their_models_and_what_to_do() -> None:
    text = refusal("t", "g", ["b", "a"], [Beat("w1", "t", "g", ("x", "y"))])
    assert "'g'" in text and "'t'" in text and "models a, b" in text
    assert "w1 (topic t, group g, models x, y)" in text
    assert "--job-topic" in text and "--group-id" in text


def test_conflicts_by_a_shared_custom_batch_topic_but_not_by_none() -> None:
    """Two groups on their own live topics that read one custom batch topic would take each other's Batch API
    lines: a conflict when their model sets differ. Workers reading no batch topic ("") share nothing."""
    shares_bulk = Beat("w1", "t.other", "g.other", ("x",), "bulk")
    reads_none = Beat("w2", "t.2", "g.2", ("x",), "")
    assert conflicts("me", "t", "g", ["a"], [shares_bulk, reads_none], "bulk") == [shares_bulk]
    assert conflicts("me", "t", "g", ["a"], [shares_bulk, reads_none], "") == []
    assert "batch topic bulk" in refusal("t", "g", ["a"], [shares_bulk])


def test_a_route_carries_the_batch_topic_its_workers_read() -> None:
    """The Batch API sends a model's lines to the batch topic the workers of its route read: the default
    sibling for an older worker (no field), a custom one when set, none when every reader has
    --no-batch-topic (a mix: the one some of them read)."""
    def beat(worker_id: str, topic: str, model: str, batch: str | None) -> WorkerInfo:
        body: dict[str, object] = {"topic": topic, "group": "g." + topic, "models": [model]}
        return WorkerInfo.from_heartbeat(worker_id, body if batch is None else body | {"batch_topic": batch})

    table = build_routes([beat("old", "t.old", "m-old", None), beat("c", "t.c", "m-c", "t.c.bulk"),
                          beat("n", "t.n", "m-n", ""), beat("mix1", "t.mix", "m-mix", ""),
                          beat("mix2", "t.mix", "m-mix", "t.mix.batch")], DEFAULT)
    assert {m: r.batch_topic for m, r in table.routes.items()} == {
        "m-old": "t.old.batch", "m-c": "t.c.bulk", "m-n": None, "m-mix": "t.mix.batch"}


def test_conflicts_when_one_workers_job_topic_is_anothers_batch_topic() -> None:
    """Any topic read by both counts: our job topic as their custom batch topic, or as the .batch sibling
    an older heartbeat (no batch_topic field) is taken to read."""
    theirs_custom = Beat("w1", "t.other", "g.other", ("x",), "t")
    older = Beat("w2", "u", "g.u", ("x",))  # reads u and, by default, u.batch
    assert conflicts("me", "t", "g", ["a"], [theirs_custom, older]) == [theirs_custom]
    assert conflicts("me", "u.batch", "g", ["a"], [theirs_custom, older]) == [older]
    assert conflicts("me", "v", "g", ["a"], [Beat("w3", "u", "g.u", ("x",), "")], "u.batch") == []
