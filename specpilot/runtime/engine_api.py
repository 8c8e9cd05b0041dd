# specpilot/runtime/engine_api.py
from dataclasses import dataclass
from typing import Protocol
@dataclass(frozen=True)
class RequestParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
class StepEngine(Protocol):
    max_batch: int
    def admit(self, rid: str, prompt_ids: list[int], params: RequestParams) -> None: ...
    def step(self) -> dict[str, list[int]]: ...   # new tokens per active request produced by this step
    def release(self, rid: str) -> None: ...       # finished or cancelled: frees its KV slot
    def active(self) -> list[str]: ...
