"""Per-request sampling settings. Pure Python: the worker builds them from a job without torch.

A new sampling option goes here (validated in __post_init__), is carried to the device by
engine.sampler.SamplingBatch and applied there as a batched tensor op.
"""

from __future__ import annotations

from dataclasses import dataclass

GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """Constrain the output to a grammar (engine/grammar.py compiles it). spec: the JSON Schema as JSON text
    (json_schema), "" (json_object: any JSON object), the pattern (regex), or a JSON list of strings (choice).
    An equal (kind, spec) reuses the compiled grammar."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")


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
    guided: GuidedDecoding | None = None  # structured output; None = unconstrained

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
