"""One request's state, shared by the scheduler (pure Python) and the model runner.

No torch here: the scheduler and block manager are tested without it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's conventions). Validated here with errors a person can act on."""

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # None = random
    presence_penalty: float = 0.0  # output tokens only
    frequency_penalty: float = 0.0  # output tokens only
    repetition_penalty: float = 1.0  # prompt and output tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int = 0  # top-N alternatives per token, 0 = none

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            problems.append(f"seed must be in [0, 2^63-1], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                problems.append(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be in [0, 20], got {self.logprobs}")
        if problems:
            raise ValueError("; ".join(problems))
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    # Overlapped steps: output tokens sampled on the device whose values the host does not have yet. They sit
    # at the end of output_token_ids as PENDING_TOKEN, so lengths and positions are right while the value is
    # unknown; the engine fills them in when the step's results reach the host.
    num_pending: int = 0

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
