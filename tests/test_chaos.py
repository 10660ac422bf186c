"""A shorter fault run (ops/chaos.py) in the suite: two stand-in workers, a real private broker and Redis
(AOF), each fault in turn; every job ends once, from its highest attempt, and the lag is 0."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
import chaos  # noqa: E402

pytestmark = [pytest.mark.stack]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_fault_run_every_job_answered_once_from_its_highest_attempt(tmp_path):
    if shutil.which("redis-server") is None or shutil.which("java") is None:
        pytest.skip("the fault run needs java and redis-server")
    with chaos.chaos(120, tmp_path / "chaos", log=print) as run:
        report = await run.run(timeout_s=240)
    print(report.table())
    assert report.violations == []
    assert report.missing == 0 and report.done + report.errors == 120
    assert report.lag == 0 and report.end_offsets == 120
    assert report.faults == ["worker SIGKILL", "worker SIGSTOP 13 s", "Redis killed 5 s", "broker SIGKILL + restart"]
    # The faults made work run again: some job ended under a later attempt than its first.
    assert sum(n for attempt, n in report.attempts.items() if attempt >= 2) > 0


async def test_the_run_creates_the_batch_sibling_the_workers_read(tmp_path, kafka_bootstrap: str) -> None:
    """Workers read the job topic's .batch sibling by default and log it missing when it is not there: the
    fault run makes it with the job and dead-letter topics (here on the shared broker, not a private one)."""
    from aiokafka import AIOKafkaConsumer
    from stoker.schemas import default_batch_topic

    run = chaos.Chaos(tmp_path, jobs=1)
    run.stack_cfg.kafka_port = int(kafka_bootstrap.rsplit(":", 1)[1])
    await run.create_topics()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap)
    await consumer.start()
    try:
        topics = await consumer.topics()
    finally:
        await consumer.stop()
    jobs = run.names.jobs_topic
    assert {jobs, run.names.dlq_topic, default_batch_topic(jobs)} <= topics
