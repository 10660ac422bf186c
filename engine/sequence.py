"""One request's state, shared by the scheduler (pure Python) and the model runner.

No torch here: the scheduler and block manager are tested without it. The scheduler changes a sequence's
tokens and status (engine/scheduler.py); everyone else reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stoker.engine.sampling_params import SamplingParams

PENDING_TOKEN = -1  # placeholder for a sampled token still on the device (see Sequence.num_pending)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the model's context)
    CANCELLED = "cancelled"  # abort()
    DEADLINE = "deadline"  # deadline_ms passed


@dataclass(slots=True, eq=False)
class Sequence:
    """A request as the scheduler sees it. Identity (not value) equality: each request is one object."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first
    deadline_ms: float | None = None  # Unix epoch ms; None = no deadline
    arrival_index: int = 0  # set by Scheduler.add: ties on priority go to the earlier arrival
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens (from the start of prompt + output) whose K/V are in the cache.
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (reported as usage.cached_tokens).
    num_cached_tokens: int = 0
    # Physical KV block ids, in order: token at position p lives in block_table[p // block_size].
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # The stop rule's token ids: eos (unless params.ignore_eos) and params.stop_token_ids.
    stop_token_ids: frozenset[int] = frozenset()
    # Output tokens sampled on the device whose values the host does not have yet. They sit at the end of
    # output_token_ids as PENDING_TOKEN, so lengths and positions are right while the value is unknown (with
    # overlapped steps the next step already computes them). The scheduler adds one per sampled chunk when a
    # step is launched and fills it in when the step's results reach the host (the three methods below).
    num_pending: int = 0

    def add_placeholder(self) -> None:
        self.output_token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def fill_placeholder(self, token_id: int) -> int:
        """The oldest placeholder is this token's (a newer one may belong to the step in flight).
        -> output tokens known now, this one included."""
        outs = self.output_token_ids
        num_known = len(outs) - self.num_pending + 1
        outs[num_known - 1] = token_id
        self.num_pending -= 1
        return num_known

    def drop_placeholders(self) -> None:
        """The sequence ended: a token still on the device is discarded."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_output_tokens(self) -> int:
        return len(self.output_token_ids) - self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has (all but the pending tail)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
