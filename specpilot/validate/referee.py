"""The strict referee for bf16 engines: judged against an fp32 reference, near-ties bounded by
measured rounding noise, and no more of them than the stock bf16 AR loop has.

Token forcing (forcing.py) calls a bf16 mismatch a near-tie when the reference's margin is within
3e-2 of the top logit's size: about 0.6 logits at a top logit of 20. A search that tries many lossy
variants finds ones that hide in that band. This referee is stricter:

1. The reference is the target in fp32, teacher-forced over prompt + the engine's output.
2. The bf16 rounding noise is measured, not assumed: the stock target in bf16 and in fp32 are
   teacher-forced over the same sequences (the stock AR loop's outputs), and at every position the
   fp32 top-two tokens' logit difference is compared between the two; the noise is the largest
   error seen (`measure_noise`). That is how far bf16 arithmetic alone moved a top-two margin of
   this model on these prompts.
3. An engine's token that is not the fp32 argmax is a near-tie only where the fp32 reference's own
   margin (top logit minus the engine token's logit) is within that noise; anything else is a
   hard failure.
4. The stock bf16 AR loop's outputs are judged the same way; an engine with hard failures, or with
   more near-ties than the stock loop on the same prompts, is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forcing import Mismatch, PromptCheck, TokenForcingReport


@torch.inference_mode()
def teacher_logits(reference, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """fp32 logits of `reference` at the positions predicting each output token ([len(output), V])."""
    device = next(reference.parameters()).device
    seq = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    cache = reference.new_cache(1, seq.shape[1])
    logits = reference(seq, cache).logits[0].float()
    return logits[len(prompt_ids) - 1: seq.shape[1] - 1]


@dataclass(frozen=True)
class Noise:
    """The measured bf16 rounding noise of a top-two logit margin."""

    value: float  # the largest |bf16 margin - fp32 margin| seen
    p99: float
    positions: int
    how: str = ("stock target in bf16 and in fp32, teacher-forced over the stock AR loop's outputs; at each "
                "position the fp32 top-two logit difference recomputed from the bf16 logits; the largest error")


def margin_errors(logits32: torch.Tensor, logits16: torch.Tensor) -> torch.Tensor:
    """Per position: |(bf16 a - bf16 b) - (fp32 a - fp32 b)| for the fp32 top-two tokens a, b."""
    top2 = logits32.topk(2, dim=-1).indices
    m32 = logits32.gather(1, top2[:, :1]) - logits32.gather(1, top2[:, 1:])
    m16 = logits16.float().gather(1, top2[:, :1]) - logits16.float().gather(1, top2[:, 1:])
    return (m16 - m32).abs()[:, 0]


def measure_noise(ref32, ref16, prompts: list[list[int]], outputs: list[list[int]]) -> Noise:
    errors = [margin_errors(teacher_logits(ref32, p, o), teacher_logits(ref16, p, o)) for p, o in zip(prompts, outputs) if o]
    if not errors:
        return Noise(0.0, 0.0, 0)
    e = torch.cat(errors)
    return Noise(float(e.max()), float(e.quantile(0.99)), int(e.numel()))


def judge(ref32, prompts: list[list[int]], outputs: list[list[int]], noise: float) -> TokenForcingReport:
    """Every output token against the fp32 reference; near-tie only within `noise` of its own margin."""
    report = TokenForcingReport(dtype="float32")
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        check = PromptCheck(prompt=i, tokens_checked=len(o))
        if o:
            pred = teacher_logits(ref32, p, o)
            cand = torch.tensor(o, device=pred.device)
            top, top_ids = pred.max(dim=-1)
            cand_logit = pred.gather(1, cand[:, None])[:, 0]
            for j in (top_ids != cand).nonzero().flatten().tolist():
                margin = float(top[j] - cand_logit[j])
                m = Mismatch(position=j, candidate=int(cand[j]), reference=int(top_ids[j]), margin=margin, tolerance=noise)
                (check.near_ties if margin <= noise else check.hard_failures).append(m)
        report.prompts.append(check)
    return report


@dataclass
class StrictVerdict:
    engine: TokenForcingReport
    stock: TokenForcingReport  # the stock bf16 AR loop judged the same way
    noise: Noise

    @property
    def passed(self) -> bool:
        return self.engine.hard_failures == 0 and self.engine.near_ties <= self.stock.near_ties

    @property
    def reason(self) -> str:
        if self.engine.hard_failures:
            return (f"strict referee: {self.engine.hard_failures} tokens differ from the fp32 reference by more "
                    f"than the measured bf16 noise ({self.noise.value:.4g} logits)")
        if self.engine.near_ties > self.stock.near_ties:
            return (f"strict referee: {self.engine.near_ties} near-ties against {self.stock.near_ties} for the stock "
                    f"bf16 AR loop on the same prompts")
        return ""

    def summary(self) -> str:
        return (f"strict referee {'PASS' if self.passed else 'FAIL'}: {self.engine.tokens_checked} tokens against "
                f"fp32, noise {self.noise.value:.4g} logits ({self.noise.positions} positions), "
                f"{self.engine.hard_failures} hard failures, {self.engine.near_ties} near-ties "
                f"(stock bf16 AR: {self.stock.near_ties})")

    def to_dict(self) -> dict:
        return {"passed": self.passed, "reason": self.reason, "noise": vars(self.noise),
                "engine": self.engine.to_dict(), "stock_ar": self.stock.to_dict()}


def strict_referee(ref32, ref16, prompts: list[list[int]], engine_outputs: list[list[int]],
                   ar_outputs: list[list[int]]) -> StrictVerdict:
    """Judge a bf16 engine's outputs (module docstring): `ref32`/`ref16` the stock target in fp32
    and bf16, `ar_outputs` the stock bf16 AR loop's outputs on the same prompts."""
    noise = measure_noise(ref32, ref16, prompts, ar_outputs)
    return StrictVerdict(judge(ref32, prompts, engine_outputs, noise.value),
                         judge(ref32, prompts, ar_outputs, noise.value), noise)
