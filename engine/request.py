"""What a caller hands the engine: one request. Pure Python (the worker builds it from a job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stoker.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """Exactly one of prompt, messages (rendered with the model's chat template) and prompt_token_ids.
    Checked by LLMEngine.add_request (engine/input_processor.py), which raises EngineRequestError."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # [{"role": ..., "content": ...}, ...]
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first
    deadline_ms: float | None = None  # Unix epoch ms; ends with finish_reason "deadline" once past
    # The served name the request asked for. An engine serves one model and ignores it; a worker holding
    # several engines (worker/models.py) routes by it. None = the worker's default model.
    model: str | None = None
