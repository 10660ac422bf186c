"""Just enough of Kafka's wire protocol to list and create topics (ApiVersions, Metadata, CreateTopics, in
their non-flexible versions): the launcher checks and makes its topics without starting a JVM tool.
Standard library only, like the rest of the launcher.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from stoker.devstack import StackError

API_CREATE_TOPICS, API_METADATA, API_VERSIONS = 19, 3, 18
ERR_TOPIC_ALREADY_EXISTS = 36
T = TypeVar("T")


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack(">h", len(raw)) + raw


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def _take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def i8(self) -> int:
        return self._take(">b")

    def i16(self) -> int:
        return self._take(">h")

    def i32(self) -> int:
        return self._take(">i")

    def nstr(self) -> str | None:
        n = self.i16()
        if n < 0:
            return None
        self.pos += n
        return self.data[self.pos - n : self.pos].decode()

    def str(self) -> str:
        return self.nstr() or ""

    def array(self, item: Callable[[], T]) -> list[T]:
        return [item() for _ in range(max(self.i32(), 0))]


class KafkaWire:
    """A blocking connection to one broker; picks the newest version of each API that both sides know."""

    OURS = {API_METADATA: range(5, 9), API_CREATE_TOPICS: range(2, 5)}  # non-flexible ones we encode

    def __init__(self, bootstrap: str, timeout: float = 5.0) -> None:
        host, _, port = bootstrap.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.correlation = 0
        r = _Reader(self._call(API_VERSIONS, 0, b""))
        error = r.i16()
        ranges = r.array(lambda: (r.i16(), r.i16(), r.i16()))
        if error:
            raise StackError(f"Kafka at {bootstrap} answered ApiVersions with error {error}")
        self.versions: dict[int, int] = {}
        for key, ours in self.OURS.items():
            theirs = next(((lo, hi) for k, lo, hi in ranges if k == key), None)
            common = [v for v in ours if theirs and theirs[0] <= v <= theirs[1]]
            if not common:
                raise StackError(f"Kafka at {bootstrap} supports API {key} versions {theirs}; "
                                 f"this launcher speaks {ours.start}-{ours.stop - 1}")
            self.versions[key] = max(common)

    def close(self) -> None:
        self.sock.close()

    def _call(self, api_key: int, version: int, body: bytes) -> bytes:
        self.correlation += 1
        header = struct.pack(">hhi", api_key, version, self.correlation) + _str("stoker-stack")
        self.sock.sendall(struct.pack(">i", len(header) + len(body)) + header + body)
        size = struct.unpack(">i", self._recv(4))[0]
        reply = self._recv(size)
        if struct.unpack_from(">i", reply)[0] != self.correlation:
            raise StackError("Kafka reply out of order (correlation id mismatch)")
        return reply[4:]  # response header v0: the correlation id only

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("Kafka closed the connection")
            buf += chunk
        return bytes(buf)

    def metadata(self) -> tuple[list[int], dict[str, list[int]]]:
        """(broker ids, {topic: leader id per partition}) for all topics; -1 marks a leaderless partition."""
        v = self.versions[API_METADATA]
        body = struct.pack(">i", -1) + b"\x00"  # all topics; allow_auto_topic_creation=false
        if v >= 8:
            body += b"\x00\x00"  # no authorized-operations lists
        r = _Reader(self._call(API_METADATA, v, body))
        r.i32()  # throttle_time_ms
        brokers = r.array(lambda: (r.i32(), r.str(), r.i32(), r.nstr())[0])
        r.nstr(), r.i32()  # cluster id, controller id

        def partition() -> tuple[int, int]:
            r.i16()
            index, leader = r.i32(), r.i32()
            if v >= 7:
                r.i32()  # leader epoch
            r.array(r.i32), r.array(r.i32), r.array(r.i32)  # replicas, isr, offline replicas (v5+)
            return index, leader

        def topic() -> tuple[int, str, list[int]]:
            error, name = r.i16(), r.str()
            r.i8()  # is_internal
            leaders = [leader for _, leader in sorted(r.array(partition))]
            if v >= 8:
                r.i32()  # topic authorized operations
            return error, name, leaders

        topics = {name: leaders for error, name, leaders in r.array(topic) if error == 0}
        return brokers, topics

    def create_topics(self, topics: Mapping[str, int], timeout_ms: int = 30000) -> dict[str, str | None]:
        """Create topics (replication 1). {topic: None on success or when it exists, else the error}."""
        body = struct.pack(">i", len(topics))
        for name, partitions in topics.items():
            body += _str(name) + struct.pack(">ihii", partitions, 1, 0, 0)  # no assignments, no configs
        body += struct.pack(">ib", timeout_ms, 0)  # validate_only=false
        r = _Reader(self._call(API_CREATE_TOPICS, self.versions[API_CREATE_TOPICS], body))
        r.i32()
        out: dict[str, str | None] = {}
        for name, error, message in r.array(lambda: (r.str(), r.i16(), r.nstr())):
            ok = error in (0, ERR_TOPIC_ALREADY_EXISTS)
            out[name] = None if ok else f"error {error}: {message or 'no message'}"
        return out


def kafka_topics(bootstrap: str, timeout: float = 2.0) -> dict[str, int] | None:
    """{topic: partitions} when a broker answers a metadata request listing itself, else None."""
    try:
        wire = KafkaWire(bootstrap, timeout)
        try:
            brokers, topics = wire.metadata()
        finally:
            wire.close()
    except (OSError, struct.error, StackError):
        return None
    return {name: len(leaders) for name, leaders in topics.items()} if brokers else None


def ensure_topics(bootstrap: str, wanted: Mapping[str, int], timeout_s: float = 30.0) -> dict[str, int]:
    """Create the missing topics and wait until every partition has a leader. Returns their sizes.

    An existing topic keeps its partition count (never shrunk or grown here); fewer than asked is reported."""
    deadline = time.monotonic() + timeout_s
    created = False
    while True:
        wire = KafkaWire(bootstrap)
        try:
            _, topics = wire.metadata()
            missing = {t: n for t, n in wanted.items() if t not in topics}
            if missing and not created:
                failed = {t: e for t, e in wire.create_topics(missing).items() if e}
                if failed:
                    raise StackError(f"creating topics on {bootstrap} failed: {failed}")
                created = True
        finally:
            wire.close()
        ready = {t: len(topics[t]) for t in wanted if t in topics and min(topics[t], default=-1) >= 0}
        if len(ready) == len(wanted):
            for t, n in ready.items():
                if n < wanted[t]:
                    print(f"topic {t} exists with {n} partitions (< {wanted[t]} asked); left as it is",
                          file=sys.stderr)
            return ready
        if time.monotonic() > deadline:
            raise StackError(f"topics {sorted(set(wanted) - set(ready))} have no leader after {timeout_s} s")
        time.sleep(0.1)

