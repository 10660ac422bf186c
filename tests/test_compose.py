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
from stoker.schemas.names import Names, default_batch_topic

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
    for var in ("STOKER_JOB_TOPIC", "STOKER_BATCH_TOPIC", "STOKER_DLQ_TOPIC"):
        assert re.search(rf'--create --if-not-exists --topic "\$\${var}"', script), f"{var} not created"
    assert init_env["STOKER_BATCH_TOPIC"] == default_batch_topic(names.jobs_topic)  # the worker reads it by default
    assert worker_env["STOKER_PREFIX"] == names.redis_prefix


def stages(dockerfile: str) -> dict[str, str]:
    """{stage name: its text from FROM to the next FROM}."""
    parts = re.split(r"^(?=FROM )", dockerfile, flags=re.M)
    return {re.match(r"FROM \S+ AS (\S+)", part).group(1): part  # type: ignore[union-attr]
            for part in parts if part.startswith("FROM ")}


def test_dockerfile_installs_the_worker_and_runs_it() -> None:
    dockerfile = stages((ROOT / "Dockerfile").read_text())["worker"]
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


def test_dockerfile_builds_the_worker_by_default_and_the_gateway_without_torch() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert list(stages(text)) == ["gateway", "worker"]  # the last stage is what a plain `docker build` makes
    gateway = stages(text)["gateway"]
    assert re.search(r"^FROM python:3\.\d+-slim AS gateway$", gateway, re.M)
    assert re.search(r'^ENTRYPOINT \["stoker-gateway"\]$', gateway, re.M)
    assert re.search(r'pip install .*"\.\[gateway\]"', gateway) and "['gateway']" in gateway
    assert "worker" not in re.findall(r"optional-dependencies'\]\['(\w+)'\]", gateway)  # no torch here


def _torch_cuda(requirements: list[str]) -> tuple[int, int] | None:
    """The CUDA (major, minor) a torch wheel's Requires-Dist pins: cuda-toolkit==13.0.2 (torch >= 2.10) or
    nvidia-cuda-runtime-cu12==12.8.90 (older wheels)."""
    for req in requirements:
        found = re.match(r"(?:cuda-toolkit(?:\[[^]]*\])?|nvidia-cuda-runtime(?:-cu\d+)?)\s*==\s*(\d+)\.(\d+)", req)
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def test_the_worker_base_image_has_the_cuda_of_the_pinned_torch_wheel() -> None:
    """A CUDA base older than the wheel's CUDA needs a driver the image does not promise, and its user-space
    libraries do not match the ones torch loads. Read from the installed torch's metadata (the same wheel
    pyproject pins), since nothing here can reach PyPI."""
    from importlib import metadata

    pin = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "worker"] if d.startswith("torch"))
    try:
        installed = metadata.version("torch")
    except metadata.PackageNotFoundError:
        pytest.skip("torch is not installed")
    assert re.fullmatch(r"torch==(\d+\.\d+)\.\*", pin) and installed.startswith(pin[7:-1]), (pin, installed)
    if "+cpu" in installed:
        pytest.skip(f"torch {installed} is a CPU build: no CUDA pin to compare")
    wheel_cuda = _torch_cuda(metadata.requires("torch") or [])
    assert wheel_cuda is not None, "no CUDA pin found in torch's Requires-Dist"
    base = re.search(r"^FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+ AS worker$", (ROOT / "Dockerfile").read_text(), re.M)
    assert base is not None
    assert (int(base.group(1)), int(base.group(2))) == wheel_cuda, (
        f"the worker's base image is CUDA {base.group(1)}.{base.group(2)}, torch {installed} brings CUDA "
        f"{wheel_cuda[0]}.{wheel_cuda[1]}")
    assert _torch_cuda(["nvidia-cuda-runtime-cu12==12.8.90; platform_system == 'Linux'"]) == (12, 8)


def test_gateway_service_reaches_the_workers_topic_and_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gateway, worker = services["gateway"], services["worker"]
    assert gateway["build"]["target"] == "gateway" and worker["build"]["target"] == "worker"
    assert gateway["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    env, worker_env = env_of(gateway), env_of(worker)
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "STOKER_JOB_TOPIC", "STOKER_PREFIX"):
        assert env[name] == worker_env[name], name
    # Every variable set is one the gateway reads: an environment twin of one of its click options.
    from stoker.gateway.app import command

    read = {p.envvar for p in command.params if getattr(p, "envvar", None)}
    assert set(env) <= read, sorted(set(env) - read)
    assert env["STOKER_GATEWAY_HOST"] == "0.0.0.0"  # inside the container; published on loopback only
    assert published(gateway)[int(env["STOKER_GATEWAY_PORT"])] == ("127.0.0.1", 8000)
    assert env["STOKER_API_KEY"] == "${STOKER_API_KEY:-}"
    assert "/health" in " ".join(gateway["healthcheck"]["test"])


def test_the_batch_api_files_are_on_a_volume_the_gateway_can_write(compose: dict[str, Any]) -> None:
    """The gateway's --storage-path holds every batch's input, output and state: on the container's own
    layer a restart or an upgrade of the gateway would lose the batches in flight."""
    gateway = compose["services"]["gateway"]
    path = env_of(gateway)["STOKER_STORAGE_PATH"]
    assert f"gateway-batches:{path}" in gateway["volumes"] and "gateway-batches" in compose["volumes"]
    # A fresh named volume takes the image folder's owner: the gateway stage makes it, owned by its user.
    stage = stages((ROOT / "Dockerfile").read_text())["gateway"]
    assert f"mkdir -p {path} && chown stoker {path}" in stage and stage.index("chown") < stage.index("USER stoker")


def test_the_triton_cache_is_on_a_volume_and_port_clashes_are_said(compose: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    cache_dir = re.search(r"TRITON_CACHE_DIR=(\S+)", dockerfile)
    assert cache_dir is not None
    assert f"triton-cache:{cache_dir.group(1)}" in compose["services"]["worker"]["volumes"]
    assert "triton-cache" in compose["volumes"]
    assert 'mkdir -p "$TRITON_CACHE_DIR"' in stages(dockerfile)["worker"]  # the volume starts owned by stoker
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    for port in (DEFAULTS.kafka_port, DEFAULTS.redis_port):
        assert str(port) in header
    assert "ops/stack up" in header and "cannot" in header
