"""The local development stack: a real Kafka broker and a real Redis server on loopback, no Docker.

Development tooling, not part of the producer's client: standard library only, so that `python3 -m
stoker.devstack up` (or `ops/stack up`) works on a fresh clone before any virtual environment exists.
`stack` launches and stops the processes; `kafka_wire` speaks just enough of Kafka's protocol to make topics.
"""


class StackError(RuntimeError):
    """Something the person running the stack can fix; the message says what."""
