"""A local stack for development and tests: a real Apache Kafka broker and a real Redis server, no Docker.

Standard library only, so `python3 -m stoker.devstack up` works on a fresh clone before any venv exists.

    python3 -m stoker.devstack up | down [--wipe] | status     (or ops/stack ..., or stoker stack ...)

- Kafka: the broker's jars come from Maven Central (a generated pom, `mvn dependency:copy-dependencies`) into
  a cache outside the repo, once. One node in KRaft combined mode (broker+controller) on loopback, started
  detached with a pid file. Topics are created and checked over Kafka's wire protocol (devstack.kafka_wire),
  so no JVM start is needed for that.
- Redis: the Debian `redis-server` (installed with apt when missing), our own instance, never the system one.

Every command is idempotent: `up` on a running stack only checks it (and creates missing topics);
`down` stops only processes whose pid file points at a process we started (checked via /proc).
`up` prints `KAFKA_BOOTSTRAP_SERVERS=...` and `REDIS_URL=...` on stdout (everything else goes to stderr),
so `set -a; eval "$(ops/stack up)"; set +a` exports them.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stoker.devstack import StackError
from stoker.devstack.kafka_wire import ensure_topics, kafka_topics

DEFAULT_KAFKA_VERSION = "4.4.0"  # newest 4.x on Maven Central when written; its POM still uses slf4j 1.7
LOG4J_VERSION = "2.24.3"  # Kafka's own log4j2 line; log4j-slf4j-impl is the slf4j 1.x binding
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
DEFAULT_JOB_TOPIC = "stoker.jobs"  # the same defaults as schemas/names.py; this file stays standalone
# Redis persistence choices: none (the default here: a restart loses every result, claim and stream), or an
# append-only file fsynced every second (a crash loses up to ~1 s of writes) or on every write.
REDIS_PERSISTENCE = ("none", "everysec", "always")


def default_dlq_topic(job_topic: str) -> str:
    """schemas.names.default_dlq_topic, repeated: this file must not import msgspec (importing schemas.names
    runs the package's __init__, which does). tests/test_stack.py checks that both rules agree."""
    return job_topic + ".dlq"


def default_batch_topic(job_topic: str) -> str:
    """schemas.names.default_batch_topic, repeated for the same reason (tests/test_stack.py checks both)."""
    return job_topic + ".batch"


DEFAULT_DLQ_TOPIC = default_dlq_topic(DEFAULT_JOB_TOPIC)
HOST = "127.0.0.1"  # loopback only: this broker has no authentication


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise StackError(f"{name}={raw!r} is not an integer") from None


def _cache_root(env: Mapping[str, str]) -> Path:
    return Path(env.get("STOKER_CACHE") or Path.home() / ".cache" / "stoker").expanduser()


@dataclass(slots=True)
class StackConfig:
    kafka_port: int = 9092
    controller_port: int = 9093
    redis_port: int = 6379
    kafka_version: str = DEFAULT_KAFKA_VERSION
    cache_dir: Path = field(default_factory=lambda: _cache_root(os.environ))  # jars, maven repo
    stack_dir: Path = field(default_factory=lambda: _cache_root(os.environ) / "stack")  # data, pids
    log_dir: Path | None = None  # default <stack_dir>/logs
    job_topic: str = DEFAULT_JOB_TOPIC
    dlq_topic: str = ""  # empty: default_dlq_topic(job_topic), the worker's and the client's default too
    job_partitions: int = 4
    dlq_partitions: int = 1
    kafka_heap_mb: int = 1024  # 384 MiB ran out of heap at ~9,600 partitions (test topics pile up)
    redis_persistence: str = "none"  # none | everysec | always (AOF in <stack_dir>/redis)
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.cache_dir, self.stack_dir = Path(self.cache_dir).expanduser(), Path(self.stack_dir).expanduser()
        self.log_dir = Path(self.log_dir).expanduser() if self.log_dir else self.stack_dir / "logs"
        ports = {"kafka_port": self.kafka_port, "controller_port": self.controller_port,
                 "redis_port": self.redis_port}
        for name, port in ports.items():
            if not 1 <= port <= 65535:
                raise StackError(f"{name}={port} is not a TCP port (1-65535)")
        if len(set(ports.values())) != 3:
            raise StackError(f"kafka, controller and redis ports must differ, got {ports}")
        for name, n in (("job_partitions", self.job_partitions), ("dlq_partitions", self.dlq_partitions)):
            if n < 1:
                raise StackError(f"{name}={n} must be >= 1")
        if not self.dlq_topic:
            self.dlq_topic = default_dlq_topic(self.job_topic)
        if self.redis_persistence not in REDIS_PERSISTENCE:
            raise StackError(f"redis_persistence={self.redis_persistence!r}: choose none, everysec or always")
        for name in (self.job_topic, self.dlq_topic):
            if not name or len(name) > 249 or not all(c.isalnum() or c in "._-" for c in name):
                raise StackError(f"topic name {name!r} is not valid in Kafka (1-249 of [A-Za-z0-9._-])")
        if self.job_topic == self.dlq_topic:
            raise StackError(f"job and dead-letter topics must differ, both are {self.job_topic!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StackConfig:
        """Defaults overridden by STOKER_* variables (the flags of the CLI override these in turn)."""
        env = os.environ if env is None else env
        cache = _cache_root(env)
        return cls(
            kafka_port=_env_int(env, "STOKER_KAFKA_PORT", 9092),
            controller_port=_env_int(env, "STOKER_KAFKA_CONTROLLER_PORT", 9093),
            redis_port=_env_int(env, "STOKER_REDIS_PORT", 6379),
            kafka_version=env.get("STOKER_KAFKA_VERSION") or DEFAULT_KAFKA_VERSION,
            cache_dir=cache,
            stack_dir=Path(env.get("STOKER_STACK_DIR") or cache / "stack"),
            log_dir=Path(env["STOKER_STACK_LOG_DIR"]) if env.get("STOKER_STACK_LOG_DIR") else None,
            job_topic=env.get("STOKER_JOB_TOPIC") or DEFAULT_JOB_TOPIC,
            dlq_topic=env.get("STOKER_DLQ_TOPIC") or "",
            job_partitions=_env_int(env, "STOKER_JOB_PARTITIONS", 4),
            dlq_partitions=_env_int(env, "STOKER_DLQ_PARTITIONS", 1),
            redis_persistence=env.get("STOKER_REDIS_PERSISTENCE") or "none",
        )

    @property
    def kafka_bootstrap(self) -> str:
        return f"{HOST}:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/0"

    @property
    def kafka_home(self) -> Path:
        return self.cache_dir / f"kafka-{self.kafka_version}"

    @property
    def kafka_dir(self) -> Path:
        return self.stack_dir / "kafka"

    @property
    def redis_dir(self) -> Path:
        return self.stack_dir / "redis"

    @property
    def kafka_log(self) -> Path:
        assert self.log_dir is not None  # set in __post_init__
        return self.log_dir / "kafka.log"

    @property
    def redis_log(self) -> Path:
        assert self.log_dir is not None
        return self.log_dir / "redis.log"

    def topics(self) -> dict[str, int]:
        """The job topic, its batch-class sibling (as many partitions: workers read both) and the DLQ."""
        return {self.job_topic: self.job_partitions, default_batch_topic(self.job_topic): self.job_partitions,
                self.dlq_topic: self.dlq_partitions}


@dataclass(slots=True)
class ServiceState:
    name: str
    address: str
    pid: int | None  # our process, alive; None when not running (or the pid file is stale/foreign)
    answering: bool  # the port answers the protocol (Kafka metadata / Redis PING)
    log: Path

    @property
    def up(self) -> bool:
        return self.pid is not None and self.answering


@dataclass(slots=True)
class StackStatus:
    kafka: ServiceState
    redis: ServiceState
    topics: dict[str, int]  # topic -> partition count, as the broker reports (empty when Kafka is down)

    @property
    def up(self) -> bool:
        return self.kafka.up and self.redis.up


@dataclass(slots=True)
class StackInfo:
    kafka_bootstrap: str
    redis_url: str
    status: StackStatus
    started: list[str]  # the services this call started; empty when the stack was already up
    elapsed_s: float

    def env(self) -> dict[str, str]:
        return {"KAFKA_BOOTSTRAP_SERVERS": self.kafka_bootstrap, "REDIS_URL": self.redis_url}


# ---------------------------------------------------------------------------------------------------
# Processes: pid files, "is this ours", detached start, stop.


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (state Z) has exited; it just awaits reaping
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _kafka_pid(cfg: StackConfig) -> int | None:
    """Our broker: alive, and its command line names our server.properties (a reused pid will not)."""
    pid = _read_pid(cfg.kafka_dir / "kafka.pid")
    props = str(cfg.kafka_dir / "server.properties")
    if pid is not None and _alive(pid) and "kafka.Kafka" in (cmd := _cmdline(pid)) and props in cmd:
        return pid
    return None


def _redis_pid(cfg: StackConfig) -> int | None:
    """Our redis: alive and running in our data dir (redis chdirs to --dir; it rewrites its cmdline)."""
    pid = _read_pid(cfg.redis_dir / "redis.pid")
    if pid is None or not _alive(pid):
        return None
    try:
        same_dir = os.path.samefile(f"/proc/{pid}/cwd", cfg.redis_dir)
        is_redis = "redis" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None
    return pid if same_dir and is_redis else None


def _port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def _spawn_detached(argv: list[str], log: Path, cwd: Path) -> int:
    """Start argv in its own session with stdio on `log`, and return its pid without owning it.

    A shell backgrounds it and exits at once, so the process is re-parented away from us: no Popen object
    outlives this call (Popen.__del__ warns about running children, an error under pytest's settings)."""
    # The child's stdio must not be our pipe, or reading the pid would wait for the child to exit.
    shell = subprocess.run(
        ["/bin/sh", "-c", 'log=$1; shift; exec "$@" </dev/null >>"$log" 2>&1 & echo $!', "sh", str(log), *argv],
        stdout=subprocess.PIPE, cwd=cwd, start_new_session=True, check=True,
    )
    return int(shell.stdout.decode().strip())


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def _stop(pid: int | None, name: str, timeout_s: float) -> bool:
    """SIGTERM, wait for a clean exit, then SIGKILL. True when a process was stopped."""
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        print(f"{name}: pid {pid} ignored SIGTERM for {timeout_s:.0f} s, sending SIGKILL", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One `up`/`down` at a time per stack dir (parallel test sessions call `up` together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------
# Kafka: jars, configuration, storage, process.

POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.stoker</groupId><artifactId>kafka-runtime</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{kafka}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-api</artifactId><version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""

# INFO to a file that rolls at 20 MB (3 kept): a dev broker lives for weeks and test runs log every topic.
LOG4J2 = """status = warn
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
"""


def _require(tool: str, why: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise StackError(f"`{tool}` is not on PATH; it is needed {why} (Debian: apt-get install -y "
                         f"{ {'java': 'openjdk-17-jre-headless', 'mvn': 'maven'}.get(tool, tool) })")
    return path


def _check_java(java: str) -> None:
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    try:
        major = int(out.split('"')[1].split(".")[0])
    except (IndexError, ValueError):
        return  # an unusual version banner: let the broker itself complain
    if major < 17:
        raise StackError(f"Kafka 4.x needs Java 17 or newer; `{java}` is Java {major}")


def fetch_kafka(cfg: StackConfig) -> Path:
    """The broker's runtime jars, downloaded by Maven once per version (marker file); returns lib/."""
    home, lib = cfg.kafka_home, cfg.kafka_home / "lib"
    marker = home / ".complete"
    if marker.exists():
        return lib
    mvn = _require("mvn", "once, to download Kafka's jars from Maven Central")
    with _locked(home.parent / f".kafka-{cfg.kafka_version}.lock"):
        if marker.exists():  # another process fetched it while we waited
            return lib
        home.mkdir(parents=True, exist_ok=True)
        (home / "pom.xml").write_text(POM.format(kafka=cfg.kafka_version, log4j=LOG4J_VERSION))
        staging = home / "lib.partial"
        shutil.rmtree(staging, ignore_errors=True)
        print(f"downloading Kafka {cfg.kafka_version} jars with Maven into {lib} (once)", file=sys.stderr)
        proc = subprocess.run(
            [mvn, "-B", "-q", "-f", str(home / "pom.xml"), f"-Dmaven.repo.local={home.parent / 'm2'}",
             f"{DEPENDENCY_PLUGIN}:copy-dependencies", "-DincludeScope=runtime",
             f"-DoutputDirectory={staging}"],
            capture_output=True, text=True,
        )
        if proc.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            raise StackError(f"Maven could not fetch org.apache.kafka:kafka_2.13:{cfg.kafka_version} "
                             f"(is the version on Maven Central?):\n{(proc.stdout + proc.stderr)[-3000:]}")
        shutil.rmtree(lib, ignore_errors=True)
        staging.rename(lib)
        marker.touch()
    return lib


def _server_properties(cfg: StackConfig) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{HOST}:{cfg.controller_port}",
        "listeners": f"PLAINTEXT://{HOST}:{cfg.kafka_port},CONTROLLER://{HOST}:{cfg.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{cfg.kafka_port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(cfg.kafka_dir / "data"),
        "num.partitions": str(cfg.job_partitions),
        "auto.create.topics.enable": "false",  # a typo in a topic name should fail, not make a topic
        "group.initial.rebalance.delay.ms": "0",  # the 3 s default delays every consumer-group join
        # one node: every replication factor / min ISR that defaults to 3 (or 2) must be 1
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",  # default 50: slow first group join on 2 cores
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _start_kafka(cfg: StackConfig, lib: Path, java: str) -> int:
    assert cfg.log_dir is not None
    kdir = cfg.kafka_dir
    kdir.mkdir(parents=True, exist_ok=True)
    props, log4j = kdir / "server.properties", kdir / "log4j2.properties"
    props.write_text(_server_properties(cfg))
    log4j.write_text(LOG4J2.format(log=cfg.kafka_log))
    classpath = ["-cp", f"{lib}/*"]
    # No log4j shutdown hook: Kafka logs its own shutdown, and the hook only warns when the JVM exits.
    jvm = [java, f"-Xmx{cfg.kafka_heap_mb}m", "-Xms128m", f"-Dlog4j2.configurationFile={log4j}",
           "-Dlog4j2.shutdownHookEnabled=false",
           "-Djava.awt.headless=true"]
    if not (kdir / "data" / "meta.properties").exists():
        # Cluster id: 16 random bytes, URL-safe base64 without padding (what `random-uuid` prints).
        cluster_id = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        # `--cluster-id=ID` in one word: an id that starts with "-" (1 in 64 do) would read as an option
        proc = subprocess.run([*jvm, *classpath, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
                               "-c", str(props)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(f"formatting Kafka storage in {kdir / 'data'} failed:\n"
                             f"{(proc.stdout + proc.stderr)[-3000:]}")
    pid = _spawn_detached([*jvm, *classpath, "kafka.Kafka", str(props)], cfg.log_dir / "kafka.out", kdir)
    (kdir / "kafka.pid").write_text(f"{pid}\n")
    return pid


def _wait_kafka(cfg: StackConfig, pid: int) -> None:
    deadline = time.monotonic() + cfg.start_timeout_s
    while kafka_topics(cfg.kafka_bootstrap) is None:
        if not _alive(pid):
            raise StackError(f"Kafka exited during start-up. {cfg.kafka_log}:\n{_tail(cfg.kafka_log)}\n"
                             f"{cfg.log_dir}/kafka.out:\n{_tail(Path(str(cfg.log_dir)) / 'kafka.out')}")
        if time.monotonic() > deadline:
            raise StackError(f"Kafka did not answer on {cfg.kafka_bootstrap} within {cfg.start_timeout_s} s; "
                             f"see {cfg.kafka_log}:\n{_tail(cfg.kafka_log)}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------------
# Redis.


def redis_ping(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_config(port: int, name: str, timeout: float = 1.0) -> str | None:
    """CONFIG GET `name` over RESP (the value, or None when Redis does not answer)."""
    command = b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in (b"CONFIG", b"GET", name.encode()))
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"*3\r\n" + command)
            reply = s.recv(4096)
    except OSError:
        return None
    lines = reply.split(b"\r\n")  # *2, $len, name, $len, value, ''
    return lines[4].decode() if len(lines) >= 5 and lines[0] == b"*2" else None


def _redis_persistence_args(persistence: str) -> list[str]:
    # RDB snapshots stay off either way: the AOF alone is what the promise needs (see the README).
    if persistence == "none":
        return ["--save", "", "--appendonly", "no"]
    return ["--save", "", "--appendonly", "yes", "--appendfsync", persistence]


def _running_persistence(port: int) -> str | None:
    if redis_config(port, "appendonly") == "no":
        return "none"
    return redis_config(port, "appendfsync")


def _redis_binary() -> str:
    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists()
                                             else None)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise StackError("redis-server is not installed; install it (Debian: apt-get install -y redis-server)")
    print("installing redis-server with apt-get", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)  # stale package lists
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(f"apt-get install redis-server failed:\n{proc.stderr[-2000:]}")
    return shutil.which("redis-server") or "/usr/bin/redis-server"


def _start_redis(cfg: StackConfig) -> int:
    assert cfg.log_dir is not None
    cfg.redis_dir.mkdir(parents=True, exist_ok=True)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    pid_file = cfg.redis_dir / "redis.pid"
    pid_file.unlink(missing_ok=True)
    proc = subprocess.run(
        [_redis_binary(), "--port", str(cfg.redis_port), "--bind", HOST, "--dir", str(cfg.redis_dir),
         "--daemonize", "yes", "--pidfile", str(pid_file), "--logfile", str(cfg.redis_log),
         *_redis_persistence_args(cfg.redis_persistence)],
        capture_output=True, text=True, start_new_session=True,
    )
    if proc.returncode != 0:
        raise StackError(f"redis-server failed to start: {proc.stdout}{proc.stderr}\n{_tail(cfg.redis_log)}")
    deadline = time.monotonic() + 10
    while not redis_ping(cfg.redis_port):
        if time.monotonic() > deadline:
            raise StackError(f"Redis did not answer PING on {HOST}:{cfg.redis_port}; "
                             f"see {cfg.redis_log}:\n{_tail(cfg.redis_log)}")
        time.sleep(0.05)
    pid = _read_pid(pid_file)
    if pid is None:
        raise StackError(f"redis-server started but wrote no pid file at {pid_file}")
    return pid


# ---------------------------------------------------------------------------------------------------
# The API: up / down / status.


def status(cfg: StackConfig) -> StackStatus:
    topics = kafka_topics(cfg.kafka_bootstrap)
    return StackStatus(
        kafka=ServiceState("kafka", cfg.kafka_bootstrap, _kafka_pid(cfg), topics is not None, cfg.kafka_log),
        redis=ServiceState("redis", f"{HOST}:{cfg.redis_port}", _redis_pid(cfg), redis_ping(cfg.redis_port),
                           cfg.redis_log),
        topics=topics or {},
    )


def _foreign(port: int, what: str, flag: str, env: str) -> StackError:
    return StackError(f"port {port} ({what}) is in use by a process this launcher did not start; stop it, "
                      f"or pick another port with {flag} / {env}")


def up(cfg: StackConfig) -> StackInfo:
    """Start what is not running (idempotent), wait until both answer, ensure the topics exist."""
    t0 = time.monotonic()
    started: list[str] = []
    assert cfg.log_dir is not None
    with _locked(cfg.stack_dir / ".lock"):
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        if _redis_pid(cfg) is None:
            if _port_open(cfg.redis_port):
                raise _foreign(cfg.redis_port, "Redis", "--redis-port", "STOKER_REDIS_PORT")
            _start_redis(cfg)
            started.append("redis")
        elif not redis_ping(cfg.redis_port):
            raise StackError(f"our redis (pid {_redis_pid(cfg)}) does not answer PING; "
                             f"see {cfg.redis_log}, or run `down` then `up`")
        elif (running := _running_persistence(cfg.redis_port)) not in (None, cfg.redis_persistence):
            print(f"redis: already running with persistence {running}, not {cfg.redis_persistence}; it takes "
                  "effect at the next start (`down`, then `up`: the data stays unless --wipe)", file=sys.stderr)
        kafka_pid = _kafka_pid(cfg)
        if kafka_pid is None:
            for port, what in ((cfg.kafka_port, "Kafka"), (cfg.controller_port, "Kafka controller")):
                if _port_open(port):
                    raise _foreign(port, what, "--kafka-port/--controller-port",
                                   "STOKER_KAFKA_PORT/STOKER_KAFKA_CONTROLLER_PORT")
            java = _require("java", "to run the Kafka broker")
            _check_java(java)
            kafka_pid = _start_kafka(cfg, fetch_kafka(cfg), java)
            started.append("kafka")
        _wait_kafka(cfg, kafka_pid)
        ensure_topics(cfg.kafka_bootstrap, cfg.topics())
        st = status(cfg)
    return StackInfo(cfg.kafka_bootstrap, cfg.redis_url, st, started, time.monotonic() - t0)


def down(cfg: StackConfig, wipe: bool = False) -> list[str]:
    """Stop our Kafka and Redis (never anyone else's). `wipe` also deletes their data. Returns what stopped."""
    stopped = []
    with _locked(cfg.stack_dir / ".lock"):
        # Kafka first: a clean broker shutdown needs no Redis, and stopping it takes longer.
        if _stop(_kafka_pid(cfg), "kafka", cfg.stop_timeout_s):
            stopped.append("kafka")
        if _stop(_redis_pid(cfg), "redis", cfg.stop_timeout_s):
            stopped.append("redis")
        for pid_file in (cfg.kafka_dir / "kafka.pid", cfg.redis_dir / "redis.pid"):
            pid_file.unlink(missing_ok=True)
        if wipe:
            shutil.rmtree(cfg.kafka_dir, ignore_errors=True)
            shutil.rmtree(cfg.redis_dir, ignore_errors=True)
    return stopped


# ---------------------------------------------------------------------------------------------------
# CLI.


def _print_status(st: StackStatus, cfg: StackConfig) -> None:
    for s in (st.kafka, st.redis):
        state = "up" if s.up else ("not answering" if s.pid else ("foreign" if s.answering else "down"))
        pid = f"pid {s.pid}" if s.pid else "no pid"
        print(f"{s.name:<6} {state:<13} {s.address:<16} {pid:<10} log {s.log}", file=sys.stderr)
    if st.topics:
        wanted = ", ".join(f"{t} ({st.topics.get(t, 'missing')} partitions)" for t in cfg.topics())
        print(f"topics {wanted}", file=sys.stderr)
    print(f"data   {cfg.stack_dir}", file=sys.stderr)
    if st.redis.up:
        print(f"redis persistence {_running_persistence(cfg.redis_port)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stoker stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--kafka-port", type=int, help="env STOKER_KAFKA_PORT (default 9092)")
    parser.add_argument("--controller-port", type=int, help="env STOKER_KAFKA_CONTROLLER_PORT (default 9093)")
    parser.add_argument("--redis-port", type=int, help="env STOKER_REDIS_PORT (default 6379)")
    parser.add_argument("--kafka-version", help=f"env STOKER_KAFKA_VERSION (default {DEFAULT_KAFKA_VERSION})")
    parser.add_argument("--stack-dir", type=Path, help="data and pid files; env STOKER_STACK_DIR")
    parser.add_argument("--log-dir", type=Path, help="env STOKER_STACK_LOG_DIR (default <stack-dir>/logs)")
    parser.add_argument("--job-partitions", type=int, help="env STOKER_JOB_PARTITIONS (default 4)")
    parser.add_argument("--dlq-partitions", type=int, help="env STOKER_DLQ_PARTITIONS (default 1)")
    parser.add_argument("--redis-persistence", choices=REDIS_PERSISTENCE,
                        help="up: Redis append-only file fsynced on every write (always), every second "
                             "(everysec), or none; env STOKER_REDIS_PERSISTENCE (default none)")
    parser.add_argument("--wipe", action="store_true", help="down: also delete Kafka's and Redis' data")
    args = parser.parse_args(argv)
    try:
        cfg = StackConfig.from_env()
        overrides = {k: getattr(args, k) for k in ("kafka_port", "controller_port", "redis_port",
                                                   "kafka_version", "stack_dir", "log_dir",
                                                   "job_partitions", "dlq_partitions", "redis_persistence")}
        for key, value in overrides.items():
            if value is not None:
                setattr(cfg, key, value)
        if args.stack_dir is not None and args.log_dir is None:
            cfg.log_dir = None
        cfg.__post_init__()  # re-validate after the flags
        if args.command == "up":
            info = up(cfg)
            what = f"started {', '.join(info.started)}" if info.started else "already up"
            print(f"stack {what} in {info.elapsed_s:.1f} s", file=sys.stderr)
            _print_status(info.status, cfg)
            for k, v in info.env().items():
                print(f"{k}={v}")
            return 0
        if args.command == "down":
            stopped = down(cfg, wipe=args.wipe)
            print(f"stopped {', '.join(stopped)}" if stopped else "nothing of ours was running",
                  file=sys.stderr)
            return 0
        st = status(cfg)
        _print_status(st, cfg)
        if st.up:
            print(f"KAFKA_BOOTSTRAP_SERVERS={cfg.kafka_bootstrap}\nREDIS_URL={cfg.redis_url}")
        return 0 if st.up else 3  # LSB: 3 = not running
    except StackError as e:
        print(f"stack: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
