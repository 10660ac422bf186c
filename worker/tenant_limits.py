"""Per-tenant limits counted in Redis, so they hold across every worker of a group: requests running at once,
and tokens per minute (prompt + completion).

Admission asks the gate script about a round's candidates in one call. For each it checks, atomically:
  running   a sorted set per tenant, member = request id, score = when its lease ends (ms, Redis's clock);
            expired members are dropped first, so a worker that died frees its tenant's slots within a
            lease (the claim TTL). The worker renews its members with its claims and removes them at the end.
  tokens    a token bucket per tenant (a hash: level, at), refilled at tokens_per_minute / 60 per second up
            to `burst_s` seconds' worth. A job takes its estimated tokens (prompt + max_tokens) when it is
            admitted; the level may not be below min(estimate, capacity) then. When it ends the difference to
            its real tokens is given back (or taken: a prompt that tokenized longer than guessed).
A job refused stays in the backlog; the worker skips its tenant for a short while and admits others.
The time is Redis's (TIME), so workers with skewed clocks share one bucket correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config imports this module's parsers; Redis itself only where the gate runs
    import redis.asyncio as aioredis

ANY_TENANT = "*"  # a limit given for "*" applies to every tenant that has none of its own

# KEYS per candidate: running set, token bucket. ARGV: lease_ms, then per candidate: request id, estimated
# tokens, max running (-1: none), tokens per minute (-1: none), capacity (tokens). Returns per candidate 0
# (admitted), 1 (over its running limit), 2 (over its token rate).
_GATE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS / 2 do
  local running, bucket = KEYS[2 * i - 1], KEYS[2 * i]
  local a = 2 + (i - 1) * 5
  local rid, cost, max_running = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local tpm, capacity = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local verdict = 0
  if max_running >= 0 then
    redis.call('ZREMRANGEBYSCORE', running, '-inf', now)
    if not redis.call('ZSCORE', running, rid) and redis.call('ZCARD', running) >= max_running then
      verdict = 1
    end
  end
  if verdict == 0 and tpm >= 0 then
    local state = redis.call('HMGET', bucket, 'level', 'at')
    local level, at = tonumber(state[1]) or capacity, tonumber(state[2]) or now
    level = math.min(capacity, level + (now - at) * tpm / 60000)
    if level < math.min(cost, capacity) then
      verdict = 2
    else
      level = level - cost
    end
    redis.call('HSET', bucket, 'level', tostring(level), 'at', now)
    redis.call('PEXPIRE', bucket, math.floor(capacity * 60000 / math.max(tpm, 1)) + 60000)
  end
  if verdict == 0 and max_running >= 0 then
    redis.call('ZADD', running, now + lease, rid)
    redis.call('PEXPIRE', running, lease * 2)
  end
  out[i] = verdict
end
return out
"""

# KEYS: token bucket. ARGV: tokens to give back (negative: to take), tokens per minute, capacity.
_SETTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local back, tpm, capacity = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'level', 'at')
local level, at = tonumber(state[1]) or capacity, tonumber(state[2]) or now
level = math.min(capacity, math.min(capacity, level + (now - at) * tpm / 60000) + back)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.floor(capacity * 60000 / math.max(tpm, 1)) + 60000)
return 0
"""

# KEYS: running set. ARGV: lease_ms, then request ids: renew the ids still members (XX: never re-add one).
_RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 0
"""


class Verdict:
    ADMITTED, OVER_RUNNING, OVER_TOKENS = 0, 1, 2
    NAMES = ("admitted", "max_running", "tokens_per_minute")


def parse_limits(specs: tuple[str, ...] | list[str], what: str) -> dict[str, int]:
    """`("acme=10", "*=4")` -> {"acme": 10, "*": 4}; a bad spec raises ValueError naming it."""
    out: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.rpartition("=")
        if not (sep and name and value.isdigit() and int(value) >= 1):
            raise ValueError(f"{what} takes TENANT=N with a whole number N >= 1 (TENANT '*' = every tenant "
                             f"without its own), got {spec!r}")
        out[name] = int(value)
    return out


@dataclass(slots=True)
class TenantLimits:
    """The configured limits: {tenant or '*': value}. Jobs without a tenant are never limited."""

    max_running: dict[str, int] = field(default_factory=dict)
    tokens_per_minute: dict[str, int] = field(default_factory=dict)
    burst_s: float = 60.0  # the token bucket holds this many seconds of a tenant's rate

    def __bool__(self) -> bool:
        return bool(self.max_running or self.tokens_per_minute)

    def of(self, tenant: str | None) -> tuple[int, int]:
        """(max running, tokens per minute) of a tenant; -1 = no limit."""
        if tenant is None:
            return -1, -1
        running = self.max_running.get(tenant, self.max_running.get(ANY_TENANT, -1))
        return running, self.tokens_per_minute.get(tenant, self.tokens_per_minute.get(ANY_TENANT, -1))

    def capacity(self, tokens_per_minute: int) -> int:
        return max(1, int(tokens_per_minute * self.burst_s / 60))


@dataclass(slots=True)
class _Held:
    tenant: str
    reserved: int  # tokens taken from the bucket at admission (0 without a token limit)
    used: int = 0  # tokens the request has really cost so far (prompt once scheduled, then each token)
    counted: bool = False  # holds a member of the tenant's running set


class TenantGate:
    """The Redis side of the limits, and what this worker holds against them (per request id)."""

    def __init__(self, client: aioredis.Redis, prefix: str, limits: TenantLimits, lease_ms: int):
        self.limits = limits
        self.prefix = prefix
        self.lease_ms = lease_ms
        self._client = client
        self._gate = client.register_script(_GATE_LUA)
        self._settle = client.register_script(_SETTLE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self.held: dict[str, _Held] = {}
        self._to_settle: list[tuple[str, int]] = []  # (tenant, tokens back), sent by flush()
        self._to_release: list[tuple[str, str]] = []  # (tenant, request id) to drop from the running set

    def running_key(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:running:{tenant}"

    def bucket_key(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:tokens:{tenant}"

    def limited(self, tenant: str | None) -> bool:
        return self.limits.of(tenant) != (-1, -1)

    async def ask(self, candidates: list[tuple[str, str, int]]) -> list[int]:
        """Verdicts for (request id, tenant, estimated tokens) in order, each admitted one held from now."""
        keys: list[str] = []
        args: list[Any] = [self.lease_ms]
        for rid, tenant, cost in candidates:
            max_running, tpm = self.limits.of(tenant)
            keys += [self.running_key(tenant), self.bucket_key(tenant)]
            args += [rid, cost, max_running, tpm, self.limits.capacity(tpm) if tpm > 0 else 0]
        verdicts = [int(v) for v in await self._gate(keys=keys, args=args)]
        for (rid, tenant, cost), verdict in zip(candidates, verdicts, strict=True):
            if verdict == Verdict.ADMITTED:
                max_running, tpm = self.limits.of(tenant)
                self.held[rid] = _Held(tenant, cost if tpm > 0 else 0, counted=max_running >= 0)
        return verdicts

    def used(self, request_id: str, tokens: int) -> None:
        held = self.held.get(request_id)
        if held is not None:
            held.used += tokens

    def release(self, request_id: str) -> None:
        """The request ended here (or left us): give back its slot and what it reserved beyond its use."""
        held = self.held.pop(request_id, None)
        if held is None:
            return
        if held.reserved:
            self._to_settle.append((held.tenant, held.reserved - held.used))
        if held.counted:
            self._to_release.append((held.tenant, request_id))

    @property
    def pending(self) -> bool:
        return bool(self._to_settle or self._to_release)

    async def flush(self) -> None:
        """Send the releases and settlements queued by release() (one pipeline)."""
        settle, self._to_settle = self._to_settle, []
        drop, self._to_release = self._to_release, []
        if not settle and not drop:
            return
        try:
            # `async with` returns the connection even when the script load fails before execute's cleanup
            async with self._client.pipeline(transaction=False) as pipe:
                for tenant, rid in drop:
                    pipe.zrem(self.running_key(tenant), rid)
                for tenant, back in settle:
                    tpm = self.limits.of(tenant)[1]
                    if back and tpm > 0:
                        await self._settle(keys=[self.bucket_key(tenant)],
                                           args=[back, tpm, self.limits.capacity(tpm)], client=pipe)
                await pipe.execute()
        except BaseException:
            self._to_settle[:0], self._to_release[:0] = settle, drop  # sent again by the next flush
            raise

    async def renew(self) -> None:
        """Extend the leases of the running-set members this worker holds (with its claims)."""
        by_tenant: dict[str, list[str]] = {}
        for rid, held in self.held.items():
            if held.counted:
                by_tenant.setdefault(held.tenant, []).append(rid)
        if not by_tenant:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for tenant, ids in by_tenant.items():
                await self._renew(keys=[self.running_key(tenant)], args=[self.lease_ms, *ids], client=pipe)
            await pipe.execute()
