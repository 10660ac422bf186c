"""Everything the worker says to Redis: events out, claims, attempts, cancels, heartbeat.

Each step's events leave in ONE pipeline. Its first command is a small Lua script that does PUBLISH +
XADD (MAXLEN ~ cap) for every event of the step, the stream's EXPIRE on a request's first and last event,
and for terminal events the result key (SET EX) and the release of our claim. Why a script rather than
three plain commands per event: redis-py packs and parses every command in pure Python, which capped a
plain pipeline at ~31k events/s of worker CPU; one script call carrying all of a step's events measured
~390k events/s (both on this 2-core machine, 256 requests per step), leaving the worker's core for Kafka
and the engine. The script touches keys computed client-side and passed in KEYS, so it also runs on a
Redis Cluster when the prefix carries a hash tag (e.g. `{stoker}`).

Claims and attempts go through a second script (atomic check-and-claim, so two workers can never both
start the same request), renewals through a third (renew only claims still ours, and report cancels).
Every call retries with backoff while Redis is unreachable: the caller simply waits, commits stay held,
nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas.names import STREAM_FIELD, Names

log = logging.getLogger("stoker.worker.redis")
T = TypeVar("T")

# KEYS: per event (channel, stream[, result, claim]); ARGV: cap, ttl_s, token, then per event
# (kind, payload) where kind 0 = chunk, 1 = first chunk (set the stream's TTL), 2 = terminal (TTL, result,
# release the claim if it is still ours), 3 = terminal only if the id has no result yet (the answer to a
# rejected record, which claims nothing: an id that already ended must not get a second terminal event).
# A terminal event brings 4 keys, the others 2.
_PUBLISH_LUA = """
local cap, ttl, token = ARGV[1], ARGV[2], ARGV[3]
local k, a = 1, 4
while a <= #ARGV do
  local kind, payload = ARGV[a], ARGV[a + 1]
  local terminal = kind == '2' or kind == '3'
  if not (kind == '3' and redis.call('EXISTS', KEYS[k + 2]) == 1) then
    redis.call('PUBLISH', KEYS[k], payload)
    redis.call('XADD', KEYS[k + 1], 'MAXLEN', '~', cap, '*', 'FIELD', payload)
    if kind ~= '0' then redis.call('EXPIRE', KEYS[k + 1], ttl) end
    if terminal then
      -- NX: the first terminal event stands (a worker that lost its claim must not overwrite the winner's)
      redis.call('SET', KEYS[k + 2], payload, 'EX', ttl, 'NX')
      if redis.call('GET', KEYS[k + 3]) == token then redis.call('DEL', KEYS[k + 3]) end
    end
  end
  k = k + (terminal and 4 or 2)
  a = a + 2
end
return a
""".replace("FIELD", STREAM_FIELD)

# KEYS per job: result, cancelled, claim, attempts. ARGV: token, claim_ttl_ms, attempts_ttl_s.
# Returns per job a pair: status ('done' | 'busy' | 'run' | 'cancelled') and the attempt number (0 unless
# claimed). Atomic, so a result written or a claim taken by another worker can't slip in between.
_ADMIT_LUA = """
local token, claim_ttl, attempts_ttl = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for i = 1, #KEYS, 4 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[#out + 1] = 'done'; out[#out + 1] = 0
  else
    local owner = redis.call('GET', KEYS[i + 2])
    if owner and owner ~= token then
      out[#out + 1] = 'busy'; out[#out + 1] = 0
    else
      redis.call('SET', KEYS[i + 2], token, 'PX', claim_ttl)
      local n = redis.call('INCR', KEYS[i + 3])
      redis.call('EXPIRE', KEYS[i + 3], attempts_ttl)
      out[#out + 1] = (redis.call('EXISTS', KEYS[i + 1]) == 1) and 'cancelled' or 'run'
      out[#out + 1] = n
    end
  end
end
return out
"""

# KEYS per running request: claim, cancelled, result. ARGV: token, claim_ttl_ms. Returns per request
# 0 (renewed), 1 (lost: another worker holds the claim, or a result exists), 2 (renewed, but cancelled).
_RENEW_LUA = """
local token, ttl = ARGV[1], ARGV[2]
local out = {}
for i = 1, #KEYS, 3 do
  local owner = redis.call('GET', KEYS[i])
  if redis.call('EXISTS', KEYS[i + 2]) == 1 then
    out[#out + 1] = 1
  elseif owner == token or not owner then
    -- expired while Redis was away is still ours unless someone else took it meanwhile
    redis.call('SET', KEYS[i], token, 'PX', ttl)
    out[#out + 1] = (redis.call('EXISTS', KEYS[i + 1]) == 1) and 2 or 0
  else
    out[#out + 1] = 1
  end
end
return out
"""

# KEYS: claim, attempts. ARGV: token, give_back ('1' | '0'). A graceful hand-back (drain timeout): drop our
# claim and, when the attempt published nothing, take back the attempt we counted, so draining workers do
# not push a healthy job towards poison_job. An attempt that published events keeps its number: the next
# worker must stream under a higher one, or its seqs would collide with ours in the stream.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[2] == '1' and tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
  return 1
end
return 0
"""


@dataclass(slots=True)
class OutEvent:
    request_id: str
    payload: bytes
    kind: int  # 0 chunk, 1 first event of the attempt, 2 terminal, 3 terminal unless the id has a result


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

    def attempts_key(self, request_id: str) -> str:
        return f"{self.names.redis_prefix}:attempts:{request_id}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.names.redis_prefix}:worker:{worker_id}"

    async def retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it succeeds; connection trouble means wait (backoff with jitter) and retry."""
        delay = 0.05
        while True:
            try:
                return await call()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if self.stopping:
                    raise
                if self._on_retry:
                    self._on_retry(what, exc)
                log.warning("event=redis_retry op=%s delay_s=%.2f error=%r", what, delay, str(exc))
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    async def publish(self, events: list[OutEvent]) -> None:
        """One pipeline for one step's events (retried whole: a replay duplicates seqs the subscriber
        drops, never loses any)."""
        if not events:
            return
        names = self.names
        keys: list[str] = []
        args: list[bytes | str | int] = [self.stream_maxlen, self.ttl_s, self.token]
        for ev in events:
            keys.append(names.events_channel(ev.request_id))
            keys.append(names.stream(ev.request_id))
            if ev.kind >= 2:
                keys.append(names.result(ev.request_id))
                keys.append(names.claim(ev.request_id))
            args.append(ev.kind)
            args.append(ev.payload)

        async def go() -> None:
            await self._publish(keys=keys, args=args)

        await self.retry("publish", go)

    async def admit(self, request_ids: list[str]) -> list[tuple[str, int]]:
        """Claim each request unless it has a result or another worker's live claim."""
        if not request_ids:
            return []
        names = self.names
        keys: list[str] = []
        for rid in request_ids:
            keys += [names.result(rid), names.cancelled(rid), names.claim(rid), self.attempts_key(rid)]

        async def go() -> list[tuple[str, int]]:
            flat = await self._admit(keys=keys, args=[self.token, self.claim_ttl_ms, self.attempts_ttl_s])
            return [(_s(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]

        return await self.retry("admit", go)

    async def renew(self, request_ids: list[str], heartbeat: tuple[str, bytes, int] | None) -> list[int]:
        """Renew our claims (one round trip for all) and the heartbeat key; see _RENEW_LUA for the codes."""
        names = self.names
        keys: list[str] = []
        for rid in request_ids:
            keys += [names.claim(rid), names.cancelled(rid), names.result(rid)]

        async def go() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            if heartbeat is not None:
                key, value, ttl = heartbeat
                pipe.set(key, value, ex=ttl)
            if keys:
                await self._renew(keys=keys, args=[self.token, self.claim_ttl_ms], client=pipe)
            replies = await pipe.execute()
            return [int(x) for x in replies[-1]] if keys else []

        return await self.retry("renew", go)

    async def release(self, request_id: str, give_back_attempt: bool) -> None:
        await self._release(keys=[self.names.claim(request_id), self.attempts_key(request_id)],
                            args=[self.token, 1 if give_back_attempt else 0])

    async def result_exists(self, request_id: str) -> bool:
        return bool(await self.retry("exists", lambda: self.client.exists(self.names.result(request_id))))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
