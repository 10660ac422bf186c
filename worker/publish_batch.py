"""The publish script's KEYS and ARGV (worker.redis_io), packed for the wire as each step's events are made.

Each engine step makes one chunk event for each of up to max_num_seqs requests (1,024 in W2, ~10,000 events/s),
so what the worker does per event is most of its CPU beside the engine. Here an event costs one call that
appends three prepacked byte strings: a request's five keys and its group header never change within an attempt,
so they are packed once (StreamHead, kept on the request) and reused at every step; the payload is wrapped as
a RESP bulk string once. The command is then one join of these parts. (Before, events were objects grouped by
request at publish time, with a header formatted per group: 2.2 us of the loop's CPU per event at 1,024
requests per step, against 0.5 us now; BENCHMARKS.md, "Transport", has the worker's figures.)

A group is one request's events of one step: the script checks the request's claim once per group. Steps
coalesced into one call (Redis fell behind) keep one group per request per step: a request streaming in k
coalesced steps costs Redis k claim checks instead of one, and the worker no regrouping pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The script's digits for an event's kind: a chunk, the attempt's first event (sets the stream's TTL), a
# terminal event (TTL, result key, our claim released). Group headers are "<mode> <attempt> <digits>".
CHUNK, FIRST, TERMINAL = "0", "1", "2"
FIXED_ARGS = 5  # cap, ttl, token, claim ttl, attempts ttl: ARGV before the groups
KEYS_PER_GROUP = 5


def bulk(value: bytes) -> bytes:
    """A RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


@dataclass(frozen=True, slots=True)
class StreamHead:
    """What each publish of one attempt of a request repeats, packed once: its five keys (channel, stream,
    claim, attempts, result) and the header of a group that is one chunk under its claim."""

    request_id: str
    attempt: int
    keys: bytes
    chunk_header: bytes

    @classmethod
    def of(cls, request_id: str, attempt: int, keys: Sequence[str]) -> StreamHead:
        if len(keys) != KEYS_PER_GROUP:
            raise ValueError(f"a request's publish keys are {KEYS_PER_GROUP}, got {len(keys)}")
        return cls(request_id, attempt, b"".join([bulk(k.encode()) for k in keys]), bulk(b"c %d 0" % attempt))


class PublishBatch:
    """One publish call's groups, in order. `groups[i]` is group i+1's (request id, attempt): the script
    answers the numbers of the groups whose claim was lost."""

    __slots__ = ("keys", "args", "groups", "events", "terminals")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.args: list[bytes] = []
        self.groups: list[tuple[str, int]] = []
        self.events = 0
        self.terminals = 0

    def chunk(self, head: StreamHead, payload: bytes) -> None:
        """A group of one chunk under the request's claim (not its first event): the per-token path."""
        self.keys.append(head.keys)
        self.args.append(head.chunk_header)
        self.args.append(b"$%d\r\n%s\r\n" % (len(payload), payload))
        self.groups.append((head.request_id, head.attempt))
        self.events += 1

    def add(self, head: StreamHead, kinds: str, payloads: Sequence[bytes], unclaimed: bool = False) -> None:
        """A group of any events (kinds: one digit each, in order). `unclaimed`: the answer to a record that
        claims nothing, written only while the id has neither a result nor a claim (the script's mode 'u')."""
        if len(kinds) != len(payloads) or not payloads or kinds.strip("012"):
            raise ValueError(f"kinds {kinds!r} must give one of 0, 1, 2 for each of the {len(payloads)} payloads")
        self.keys.append(head.keys)
        self.args.append(bulk(b"%s %d %s" % (b"u" if unclaimed else b"c", head.attempt, kinds.encode())))
        self.args += [bulk(p) for p in payloads]
        self.groups.append((head.request_id, head.attempt))
        self.events += len(payloads)
        self.terminals += kinds.count(TERMINAL)

    def extend(self, other: PublishBatch) -> None:
        """Another batch's groups after these (its steps came later)."""
        self.keys += other.keys
        self.args += other.args
        self.groups += other.groups
        self.events += other.events
        self.terminals += other.terminals

    def __len__(self) -> int:
        return self.events

    def command(self, sha: str, fixed_args: bytes) -> bytes:
        """The whole EVALSHA command; fixed_args: the FIXED_ARGS leading arguments, packed."""
        num_keys = KEYS_PER_GROUP * len(self.groups)
        count = 3 + num_keys + FIXED_ARGS + len(self.args)
        head = b"*%d\r\n$7\r\nEVALSHA\r\n%s%s" % (count, bulk(sha.encode()), bulk(b"%d" % num_keys))
        return b"".join([head, *self.keys, fixed_args, *self.args])
