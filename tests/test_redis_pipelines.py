"""The worker's Redis pipelines that carry a Lua script hand their connection back when the script load fails.

redis-py's pipeline loads its scripts (SCRIPT EXISTS) before execute()'s own cleanup begins; a failure there left
the pipeline holding a pool connection, which leaked and warned when the pipeline was collected (CI once failed on
that warning after a Redis restart). A user whose ACL refuses SCRIPT makes the load fail the same way every time."""

from __future__ import annotations

import gc
import uuid
import warnings
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError
from stoker.schemas import Names
from stoker.worker.redis_io import RedisAccessError, RedisIO
from stoker.worker.tenant_limits import TenantGate, TenantLimits, _Held, parse_limits
from worker_harness import stack_endpoints

pytestmark = pytest.mark.stack


@pytest.fixture(name="no_script")
async def no_script_fixture(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    """A client logged in as a user that may run everything but SCRIPT."""
    _, redis_url = stack_endpoints(request)
    admin = aioredis.Redis.from_url(redis_url)
    user, password = f"noscript{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-script")
    client = aioredis.Redis.from_url(redis_url, username=user, password=password)
    yield client
    await client.aclose()
    await admin.execute_command("ACL", "DELUSER", user)
    await admin.aclose()


def _leaked(client: aioredis.Redis) -> tuple[int, list[str]]:
    """Connections the pool still counts as in use, and the ResourceWarnings that collecting garbage raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return len(client.connection_pool._in_use_connections), unclosed


async def test_renew_returns_its_connection_when_the_script_load_is_refused(no_script: aioredis.Redis) -> None:
    rio = RedisIO(no_script, Names(redis_prefix=f"rp{uuid.uuid4().hex[:8]}"), token="w1", stream_maxlen=10,
                  ttl_s=60, claim_ttl_ms=9000, attempts_ttl_s=600)
    with pytest.raises(RedisAccessError, match="permissions"):
        await rio.renew([("r1", 1)], heartbeat=None)
    assert _leaked(no_script) == (0, [])


async def test_tenant_lease_renewal_and_flush_return_their_connection_when_the_script_load_is_refused(
        no_script: aioredis.Redis) -> None:
    limits = TenantLimits(parse_limits(["acme=2"], "x"), parse_limits(["acme=600"], "y"), burst_s=6)
    gate = TenantGate(no_script, f"rp{uuid.uuid4().hex[:8]}", limits, lease_ms=5000)
    gate.held["r1"] = _Held("acme", 10, counted=True)
    with pytest.raises(NoPermissionError):
        await gate.renew()
    assert _leaked(no_script) == (0, [])
    gate.release("r1")  # queues a running-set drop and a token settlement (a script) for flush
    with pytest.raises(NoPermissionError):
        await gate.flush()
    assert _leaked(no_script) == (0, [])
    assert gate.pending  # what failed to send is kept for the next flush
