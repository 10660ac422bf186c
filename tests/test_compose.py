"""docker-compose.yml and Dockerfile agree with the local stack (devstack/stack.py) and the worker's settings.

There is no Docker engine here, so these read the files; `docker compose config` in CI would be the next step.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from stoker.devstack import stack
from stoker.schemas.names import Names

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = stack.StackConfig(stack_dir=ROOT / "var" / "unused")  # defaults only; nothing is started


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict), "docker-compose.yml must be a mapping"
    return data


@pytest.fixture(scope="module")
def worker_env_defaults() -> dict[str, Any]:
    """{env var: default} of every setting stoker-worker reads (worker/main.py's option table)."""
    from stoker.worker import main

    return {env: default for _flag, env, _type, default, _help in main._OPTIONS}


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the `- KEY=value` form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def published(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """{container port: (host ip, host port)} from short-form `ports:` entries."""
    out = {}
    for entry in service.get("ports", []):
        ip, host_port, container_port = str(entry).rsplit(":", 2) if str(entry).count(":") == 2 else (
            "0.0.0.0", *str(entry).split(":"))
        out[int(container_port)] = (ip, int(host_port))
    return out


def listeners(value: str) -> dict[str, tuple[str, int]]:
    """'NAME://host:port,...' -> {NAME: (host, port)}."""
    out = {}
    for item in value.split(","):
        name, rest = item.split("://")
        host, port = rest.rsplit(":", 1)
        out[name] = (host, int(port))
    return out


def test_services_exist_and_worker_waits_for_topics_and_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"kafka", "redis", "kafka-init", "worker"} <= set(services)
    deps = services["worker"]["depends_on"]
    assert deps["kafka-init"]["condition"] == "service_completed_successfully"
    assert deps["redis"]["condition"] == "service_healthy"
    assert services["kafka-init"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["kafka"]["healthcheck"] and services["redis"]["healthcheck"]


def test_kafka_is_the_stacks_version_in_kraft_single_node_mode(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{stack.DEFAULT_KAFKA_VERSION}"
    assert compose["services"]["kafka-init"]["image"] == kafka["image"]
    env = env_of(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert env["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] == "0"
    for key in ("OFFSETS_TOPIC_REPLICATION_FACTOR", "TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                "TRANSACTION_STATE_LOG_MIN_ISR", "SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
                "SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR"):
        assert env[f"KAFKA_{key}"] == "1", f"KAFKA_{key} must be 1 on a single node"
    # The voter is this node, on the controller listener.
    node, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split("@")
    assert node == env["KAFKA_NODE_ID"] and int(voter.rsplit(":", 1)[1]) == listeners(
        env["KAFKA_LISTENERS"])[env["KAFKA_CONTROLLER_LISTENER_NAMES"]][1]


def test_host_endpoints_match_the_local_stack_defaults(compose: dict[str, Any],
                                                       worker_env_defaults: dict[str, Any]) -> None:
    """Host tools use the same KAFKA_BOOTSTRAP_SERVERS / REDIS_URL with compose or with `ops/stack up`."""
    kafka, redis = compose["services"]["kafka"], compose["services"]["redis"]
    advertised = listeners(env_of(kafka)["KAFKA_ADVERTISED_LISTENERS"])
    host_side = [(h, p) for h, p in advertised.values() if h == "127.0.0.1"]
    assert host_side == [("127.0.0.1", DEFAULTS.kafka_port)]
    assert all(h != "0.0.0.0" for h, _ in advertised.values())
    assert published(kafka)[DEFAULTS.kafka_port] == ("127.0.0.1", DEFAULTS.kafka_port)
    assert published(redis)[6379] == ("127.0.0.1", DEFAULTS.redis_port)
    # ...and the worker's own defaults point there too.
    assert worker_env_defaults["KAFKA_BOOTSTRAP_SERVERS"] == DEFAULTS.kafka_bootstrap
    assert worker_env_defaults["REDIS_URL"] == DEFAULTS.redis_url


def test_worker_has_every_setting_it_needs(compose: dict[str, Any],
                                           worker_env_defaults: dict[str, Any]) -> None:
    services = compose["services"]
    worker = services["worker"]
    env = env_of(worker)
    needed = {"STOKER_MODEL", "KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "STOKER_JOB_TOPIC", "STOKER_DLQ_TOPIC",
              "STOKER_PREFIX", "STOKER_METRICS_PORT"}
    assert needed <= set(env), f"missing: {needed - set(env)}"
    assert set(env) <= set(worker_env_defaults), f"not read by the worker: {set(env) - set(worker_env_defaults)}"
    # Containers reach Kafka on its internal advertised listener and Redis on its service port.
    bootstrap_host, bootstrap_port = env["KAFKA_BOOTSTRAP_SERVERS"].rsplit(":", 1)
    assert (bootstrap_host, int(bootstrap_port)) in listeners(
        env_of(services["kafka"])["KAFKA_ADVERTISED_LISTENERS"]).values()
    assert bootstrap_host == "kafka"
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    # Model folder: a volume at /models, STOKER_MODEL inside it.
    assert env["STOKER_MODEL"].startswith("/models/")
    assert any(re.search(r":/models(:ro|:rw)?$", str(v)) for v in worker["volumes"])
    # Metrics port: the worker's default, published.
    assert int(env["STOKER_METRICS_PORT"]) == worker_env_defaults["STOKER_METRICS_PORT"] == 9400
    assert 9400 in published(worker)
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)


def test_topics_agree_with_the_contract_stack_and_init(compose: dict[str, Any]) -> None:
    names = Names()
    assert (names.jobs_topic, names.dlq_topic) == (stack.DEFAULT_JOB_TOPIC, stack.DEFAULT_DLQ_TOPIC)
    worker_env = env_of(compose["services"]["worker"])
    init = compose["services"]["kafka-init"]
    init_env = env_of(init)
    assert (worker_env["STOKER_JOB_TOPIC"], worker_env["STOKER_DLQ_TOPIC"]) == (names.jobs_topic, names.dlq_topic)
    assert (init_env["STOKER_JOB_TOPIC"], init_env["STOKER_DLQ_TOPIC"]) == (names.jobs_topic, names.dlq_topic)
    assert int(init_env["JOB_PARTITIONS"]) == DEFAULTS.job_partitions
    assert int(init_env["DLQ_PARTITIONS"]) == DEFAULTS.dlq_partitions
    script = "\n".join(init["command"])
    for var in ("STOKER_JOB_TOPIC", "STOKER_DLQ_TOPIC"):
        assert re.search(rf'--create --if-not-exists --topic "\$\${var}"', script), f"{var} not created"
    assert worker_env["STOKER_PREFIX"] == names.redis_prefix


def test_dockerfile_installs_the_worker_and_runs_it() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stoker-worker"] == "stoker.worker.main:main"
    assert re.search(r'^ENTRYPOINT \["stoker-worker"\]$', dockerfile, re.M)
    assert re.search(r'pip install .*"\.\[worker\]"', dockerfile)
    assert re.search(r"^FROM nvidia/cuda:\S+", dockerfile, re.M)
    assert "EXPOSE 9400" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "models"} <= set(ignored) and "pyproject.toml" not in ignored


def test_redis_persistence_choices_match_the_local_stack(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    script = "\n".join(redis["command"])
    assert env_of(redis)["STOKER_REDIS_PERSISTENCE"] == "${STOKER_REDIS_PERSISTENCE:-none}"
    assert stack.StackConfig(stack_dir=ROOT / "var" / "unused").redis_persistence == "none"  # same default
    choices = re.findall(r"^\s*([a-z|]+)\) exec", script, re.M)
    assert sorted("|".join(choices).split("|")) == sorted(stack.REDIS_PERSISTENCE)
    assert '--appendonly yes --appendfsync "$$STOKER_REDIS_PERSISTENCE"' in script
    assert "redis-data:/data" in redis["volumes"] and "redis-data" in compose["volumes"]
