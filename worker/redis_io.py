"""Everything the worker says to Redis: events out, claims, attempts, cancels, heartbeat.

Each step's events leave in ONE pipeline. Its first command is a small Lua script that checks each
request's claim (does it still name this worker and attempt?) and does PUBLISH + XADD (MAXLEN ~ cap) for
every event of the step, the stream's EXPIRE on a request's first and last event, and for terminal events
the result key (SET EX) and the release of our claim. Why a script rather than
three plain commands per event: redis-py packs and parses every command in pure Python, which capped a
plain pipeline at ~31k events/s of worker CPU; one script call carrying all of a step's events measured
~390k events/s (both on this 2-core machine, 256 requests per step), leaving the worker's core for Kafka
and the engine. The script touches keys computed client-side and passed in KEYS, so it also runs on a
Redis Cluster when the prefix carries a hash tag (e.g. `{stoker}`).

Claims and attempts go through a second script (atomic check-and-claim, so two workers can never both
start the same request), renewals through a third (renew only claims still ours, and report cancels).
Every call retries with backoff while Redis is unreachable: the caller simply waits, commits stay held,
nothing is lost (the worker leaves its consumer group when an outage outlasts a bound). A refused login or
permission is not an outage: it raises RedisAccessError at once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from stoker.schemas.names import STREAM_FIELD, Names
from stoker.worker.membership import worker_index
from stoker.worker.publish_batch import PublishBatch, StreamHead, bulk

log = logging.getLogger("stoker.worker.redis")
T = TypeVar("T")

# A claim's value names its worker and attempt: "<worker token> <attempt>" (worker ids hold no whitespace).
#
# ARGV: cap, ttl_s, token, claim_ttl_ms, attempts_ttl_s, then per request group a header "<mode> <attempt>
# <kinds>" and one payload per event; kinds has one digit per event: 0 = chunk, 1 = the attempt's first event
# (sets the stream's TTL), 2 = terminal (TTL, result key, our claim released). KEYS per group: channel,
# stream, claim, attempts, result. Arguments per event matter to the worker's CPU: the command is packed by
# worker.publish_batch (a request's keys once per attempt), not by redis-py's generic per-argument packer.
# Mode 'c' (a claimed request): the group is written only while the claim still names this worker and
# attempt; a claim that expired with nobody taking over is taken back only if no result exists and the
# attempt counter still equals our attempt (or is gone with the claim). The result check stops a replay:
# a publish whose reply was lost (Redis died after applying it) is sent again whole, and its terminal event
# had already released the claim; without the check the replay took the claim back and wrote the same
# `done` a second time (seen in the fault run). Otherwise nothing of the group is written and its index is
# returned: the claim is lost, the caller stops the request. So no event of an older attempt can follow a
# newer attempt's first event, and the result key always holds the terminal event of the highest attempt.
# Mode 'u' (the answer to a rejected record, which claims nothing): written only while the id has neither a
# result (its own terminal event stands) nor a claim (it runs somewhere and will end by itself).
_PUBLISH_LUA = """
local cap, ttl, token, claim_ttl, attempts_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local lost = {}
local k, a, group = 1, 6, 0
while a <= #ARGV do
  group = group + 1
  local mode, attempt, kinds = string.match(ARGV[a], '^(%a) (%d+) (%d+)$')
  local n = #kinds
  local channel, stream, claim, attempts = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local result = KEYS[k + 4]
  local ok
  if mode == 'c' then
    local mine = token .. ' ' .. attempt
    local owner = redis.call('GET', claim)
    if owner == mine then
      ok = true
    elseif not owner and redis.call('EXISTS', result) == 0 then
      local counter = redis.call('GET', attempts)
      if (not counter) or counter == attempt then
        redis.call('SET', claim, mine, 'PX', claim_ttl)
        if not counter then redis.call('SET', attempts, attempt, 'EX', attempts_ttl) end
        ok = true
      end
    end
    if not ok then lost[#lost + 1] = group end
  else
    ok = redis.call('EXISTS', result) == 0 and redis.call('EXISTS', claim) == 0
  end
  if ok then
    for i = 1, n do
      local kind, payload = string.sub(kinds, i, i), ARGV[a + i]
      redis.call('PUBLISH', channel, payload)
      redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'FIELD', payload)
      if kind ~= '0' then redis.call('EXPIRE', stream, ttl) end
      if kind == '2' then
        redis.call('SET', result, payload, 'EX', ttl)
        if mode == 'c' then redis.call('DEL', claim) end
      end
    end
  end
  k = k + 5
  a = a + 1 + n
end
return lost
""".replace("FIELD", STREAM_FIELD)

# KEYS per job: result, cancelled, claim, attempts. ARGV: token, claim_ttl_ms, attempts_ttl_s.
# Returns per job a pair: status ('done' | 'busy' | 'run' | 'cancelled') and the attempt number (0 unless
# claimed). Atomic, so a result written or a claim taken by another worker can't slip in between. A claim of
# our own (a request we gave up) is taken again under a new attempt.
_ADMIT_LUA = """
local token, claim_ttl, attempts_ttl = ARGV[1], ARGV[2], ARGV[3]
local ours = token .. ' '
local out = {}
for i = 1, #KEYS, 4 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[#out + 1] = 'done'; out[#out + 1] = 0
  else
    local owner = redis.call('GET', KEYS[i + 2])
    if owner and string.sub(owner, 1, #ours) ~= ours then
      out[#out + 1] = 'busy'; out[#out + 1] = 0
    else
      local n = redis.call('INCR', KEYS[i + 3])
      redis.call('EXPIRE', KEYS[i + 3], attempts_ttl)
      redis.call('SET', KEYS[i + 2], ours .. n, 'PX', claim_ttl)
      out[#out + 1] = (redis.call('EXISTS', KEYS[i + 1]) == 1) and 'cancelled' or 'run'
      out[#out + 1] = n
    end
  end
end
return out
"""

# KEYS per running request: claim, cancelled, result, attempts. ARGV: token, claim_ttl_ms, then each
# request's attempt. Returns per request 0 (renewed), 1 (lost: another worker or attempt holds the claim, or
# a result exists), 2 (renewed, but cancelled). A claim that expired (Redis was away, or we were paused) is
# taken back on the same terms as in the publish script.
_RENEW_LUA = """
local token, ttl = ARGV[1], ARGV[2]
local out = {}
for i = 1, #KEYS, 4 do
  local attempt = ARGV[3 + (i - 1) / 4]
  local mine = token .. ' ' .. attempt
  local owner = redis.call('GET', KEYS[i])
  local ours = owner == mine
  if not owner then
    local counter = redis.call('GET', KEYS[i + 3])
    ours = (not counter) or counter == attempt
  end
  if redis.call('EXISTS', KEYS[i + 2]) == 1 or not ours then
    out[#out + 1] = 1
  else
    redis.call('SET', KEYS[i], mine, 'PX', ttl)
    out[#out + 1] = (redis.call('EXISTS', KEYS[i + 1]) == 1) and 2 or 0
  end
end
return out
"""

# KEYS: claim, attempts. ARGV: token and attempt, give_back ('1' | '0'). A graceful hand-back (drain
# timeout): drop our claim and, when the attempt published nothing, take back the attempt we counted, so
# draining workers do not push a healthy job towards poison_job. An attempt that published events keeps its
# number: the next worker must stream under a higher one, or its seqs would collide with ours in the stream.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[2] == '1' and tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
  return 1
end
return 0
"""


class Admission(enum.StrEnum):
    """The admit script's status for one job."""

    DONE = "done"  # a result exists: nothing to run, commit
    BUSY = "busy"  # another worker's live claim: park the job
    RUN = "run"  # claimed for us under a new attempt
    CANCELLED = "cancelled"  # claimed, but its cancel key is set: answer `cancelled` without running


class Renewal(enum.IntEnum):
    """The renew script's code for one running request."""

    RENEWED = 0
    LOST = 1  # another worker or attempt holds the claim, or a result exists: stop, let theirs stand
    CANCELLED = 2  # renewed, but its cancel key is set


class RedisAccessError(RuntimeError):
    """Redis answers but refuses us (wrong password, missing ACL permission): fatal, never retried."""


class RedisIO:
    def __init__(self, client: aioredis.Redis, names: Names, *, token: str, stream_maxlen: int,
                 ttl_s: int, claim_ttl_ms: int, attempts_ttl_s: int,
                 on_retry: Callable[[str, BaseException], None] | None = None):
        self.client = client
        self.names = names
        self.token = token  # our claim value: unique per worker process
        self.stream_maxlen = stream_maxlen
        self.ttl_s = ttl_s
        self.claim_ttl_ms = claim_ttl_ms
        self.attempts_ttl_s = attempts_ttl_s
        self._on_retry = on_retry
        self._publish = client.register_script(_PUBLISH_LUA)
        self._admit = client.register_script(_ADMIT_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self.stopping = False  # set at shutdown so retries give up instead of waiting forever
        self.down_since: float | None = None  # monotonic time of the first failure of the current outage
        self._publish_args = b"".join(bulk(str(v).encode()) for v in (stream_maxlen, ttl_s, token, claim_ttl_ms,
                                                                       attempts_ttl_s))

    def head(self, request_id: str, attempt: int) -> StreamHead:
        """The publish script's keys and chunk header of one attempt of a request, packed once: the caller
        keeps it for the request's every step (each key also checks the id when built)."""
        names = self.names
        return StreamHead.of(request_id, attempt, (names.events_channel(request_id), names.stream(request_id),
                                                   names.claim(request_id), self.attempts_key(request_id),
                                                   names.result(request_id)))

    async def _evalsha(self, packed: bytes, script: str) -> Any:
        """Send one EVALSHA packed by the caller on a pooled connection and read its reply. A script Redis
        does not know (restarted, flushed) is loaded and the call sent again."""
        for _ in range(2):
            pool = self.client.connection_pool
            conn = await pool.get_connection()
            try:
                await conn.send_packed_command(packed)
                return await conn.read_response()
            except NoScriptError:
                await self.client.script_load(script)
            except ResponseError:
                raise  # the whole reply was read: the connection is fine
            except BaseException:
                await conn.disconnect()  # a reply half read must not reach the next user of the connection
                raise
            finally:
                await pool.release(conn)
        raise ResponseError("NOSCRIPT after loading the script")

    def attempts_key(self, request_id: str) -> str:
        return f"{self.names.redis_prefix}:attempts:{request_id}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.names.redis_prefix}:worker:{worker_id}"

    async def retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it succeeds; connection trouble means wait (backoff with jitter) and retry.
        Refused credentials or permissions are no outage: they raise RedisAccessError at once."""
        delay = 0.05
        while True:
            try:
                result = await call()
                self.down_since = None
                return result
            except (AuthenticationError, NoPermissionError) as exc:
                raise RedisAccessError(f"Redis refused this worker's credentials or permissions ({what}): {exc}; "
                                       "check --redis-password / REDIS_PASSWORD, the URL's user and its ACL") from exc
            except ResponseError as exc:
                if str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                    raise RedisAccessError(f"Redis refused this worker ({what}): {exc}; check --redis-password / "
                                           "REDIS_PASSWORD, the URL's user and its ACL") from exc
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if self.stopping:
                    raise
                if self.down_since is None:
                    self.down_since = time.monotonic()
                if self._on_retry:
                    self._on_retry(what, exc)
                log.warning("event=redis_retry op=%s delay_s=%.2f error=%r", what, delay, str(exc))
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    async def publish(self, batch: PublishBatch) -> set[tuple[str, int]]:
        """One script call for a batch of steps' events (retried whole: a replay duplicates seqs the
        subscriber drops, never loses any). Returns the (request id, attempt) pairs whose claim was lost:
        none of their events in this call was written."""
        if not batch.groups:
            return set()
        # Packed by PublishBatch, not by redis-py: its generic packer cost ~1/4 of the worker's event-loop CPU
        # at 512 events per step (py-spy on ops/bench_transport.py).
        packed = batch.command(self._publish.sha, self._publish_args)

        async def go() -> list[int]:
            return [int(x) for x in await self._evalsha(packed, _PUBLISH_LUA)]

        lost = await self.retry("publish", go)
        return {batch.groups[i - 1] for i in lost}

    async def admit(self, request_ids: list[str]) -> list[tuple[Admission, int]]:
        """Claim each request unless it has a result or another worker's live claim."""
        if not request_ids:
            return []
        names = self.names
        keys: list[str] = []
        for rid in request_ids:
            keys += [names.result(rid), names.cancelled(rid), names.claim(rid), self.attempts_key(rid)]

        async def go() -> list[tuple[Admission, int]]:
            flat = await self._admit(keys=keys, args=[self.token, self.claim_ttl_ms, self.attempts_ttl_s])
            return [(Admission(_s(flat[i])), int(flat[i + 1])) for i in range(0, len(flat), 2)]

        return await self.retry("admit", go)

    async def renew(self, running: list[tuple[str, int]],
                    heartbeat: tuple[str, bytes, int] | None) -> list[Renewal]:
        """Renew our claims on (request id, attempt) pairs in one round trip, and the heartbeat key (and
        our entry in the worker index, worker.membership)."""
        names = self.names
        keys: list[str] = []
        for rid, _ in running:
            keys += [names.claim(rid), names.cancelled(rid), names.result(rid), self.attempts_key(rid)]

        async def go() -> list[Renewal]:
            # `async with` hands the connection back even when the pipeline's script load fails before
            # execute's own cleanup runs (redis-py leaves it held, and warns when the pipeline is collected)
            async with self.client.pipeline(transaction=False) as pipe:
                if heartbeat is not None:
                    key, value, ttl = heartbeat
                    pipe.set(key, value, ex=ttl)
                    pipe.zadd(worker_index(self.names.redis_prefix), {self.token: time.time() * 1000})
                if keys:
                    await self._renew(keys=keys, args=[self.token, self.claim_ttl_ms, *(a for _, a in running)],
                                      client=pipe)
                replies = await pipe.execute()
            return [Renewal(int(x)) for x in replies[-1]] if keys else []

        return await self.retry("renew", go)

    async def release(self, request_id: str, attempt: int, give_back_attempt: bool) -> None:
        await self._release(keys=[self.names.claim(request_id), self.attempts_key(request_id)],
                            args=[f"{self.token} {attempt}", 1 if give_back_attempt else 0])

    async def cancelled_among(self, request_ids: list[str]) -> list[str]:
        """The ids of these that carry a cancel key (one round trip)."""
        if not request_ids:
            return []
        keys = [self.names.cancelled(rid) for rid in request_ids]
        flags = await self.retry("cancelled", lambda: self.client.mget(keys))
        return [rid for rid, flag in zip(request_ids, flags, strict=True) if flag is not None]


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
