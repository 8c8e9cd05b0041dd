"""Token forcing, the referee: every output token of an engine is checked against the reference.

The reference target runs once per prompt, teacher-forced over prompt + candidate output. Each
candidate token must be the reference's argmax at its position. Where it is not, the margin
(reference top logit minus the candidate's logit) is recorded: within the dtype's tolerance it is
a benign near-tie (two tokens the dtype cannot tell apart; another reduction order may pick
either), beyond it a hard failure that rejects the engine. Because the reference is conditioned on
the candidate's own prefix, a benign near-tie does not poison the tokens after it: they are judged
on the path the engine actually took.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


# Near-tie tolerance relative to max(1, |top logit|): a few units in the last place of the
# dtype's logits after a long reduction. fp32 paths that differ only in reduction order land
# around 1e-6 relative; bf16 has 8 mantissa bits (2^-8 = 3.9e-3 per rounding).
RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def tolerance(dtype: str, top_logit: float) -> float:
    return RELATIVE_TOLERANCE[dtype] * max(1.0, abs(top_logit))


@dataclass(frozen=True)
class Mismatch:
    position: int  # index into the output tokens
    candidate: int
    reference: int
    margin: float
    tolerance: float


@dataclass
class PromptCheck:
    prompt: int
    tokens_checked: int
    hard_failures: list[Mismatch] = field(default_factory=list)
    near_ties: list[Mismatch] = field(default_factory=list)

    @property
    def first_divergence(self) -> int | None:
        found = [m.position for m in self.hard_failures + self.near_ties]
        return min(found) if found else None


@dataclass
class TokenForcingReport:
    dtype: str
    prompts: list[PromptCheck] = field(default_factory=list)

    @property
    def tokens_checked(self) -> int:
        return sum(p.tokens_checked for p in self.prompts)

    @property
    def hard_failures(self) -> int:
        return sum(len(p.hard_failures) for p in self.prompts)

    @property
    def near_ties(self) -> int:
        return sum(len(p.near_ties) for p in self.prompts)

    @property
    def passed(self) -> bool:
        return self.hard_failures == 0

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "passed": self.passed,
            "tokens_checked": self.tokens_checked,
            "hard_failures": self.hard_failures,
            "near_ties": self.near_ties,
            "relative_tolerance": RELATIVE_TOLERANCE[self.dtype],
            "prompts": [
                {
                    "prompt": p.prompt,
                    "tokens_checked": p.tokens_checked,
                    "first_divergence": p.first_divergence,
                    "hard_failures": [asdict(m) for m in p.hard_failures],
                    "near_ties": [asdict(m) for m in p.near_ties],
                }
                for p in self.prompts
            ],
        }

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"token forcing {verdict}: {self.tokens_checked} tokens checked, "
                f"{self.hard_failures} hard failures, {self.near_ties} near-ties")


@torch.inference_mode()
def check_prompt(reference, ref_cfg, prompt_ids: list[int], output_ids: list[int], dtype: str,
                 index: int = 0) -> PromptCheck:
    """Teacher-force `reference` over prompt + output once and judge every output token."""
    check = PromptCheck(prompt=index, tokens_checked=len(output_ids))
    if not output_ids:
        return check
    device = next(reference.parameters()).device
    seq = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    cache = reference.new_cache(1, seq.shape[1])  # a hybrid target brings its own cache
    logits = reference(seq, cache).logits[0].float()
    # logits at position i predict token i+1: output token j sits at len(prompt)+j
    pred = logits[len(prompt_ids) - 1 : seq.shape[1] - 1]
    cand = torch.tensor(output_ids, device=device)
    top, top_ids = pred.max(dim=-1)
    cand_logit = pred.gather(1, cand[:, None])[:, 0]
    wrong = (top_ids != cand).nonzero().flatten().tolist()
    for j in wrong:
        margin = float(top[j] - cand_logit[j])
        tol = tolerance(dtype, float(top[j]))
        m = Mismatch(position=j, candidate=int(cand[j]), reference=int(top_ids[j]), margin=margin, tolerance=tol)
        # an exact tie (margin 0) with a different argmax index is a near-tie too
        (check.near_ties if margin <= tol else check.hard_failures).append(m)
    return check


def force_tokens(reference, ref_cfg, prompts: list[list[int]], outputs: list[list[int]], dtype: str) -> TokenForcingReport:
    report = TokenForcingReport(dtype=dtype)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        report.prompts.append(check_prompt(reference, ref_cfg, p, o, dtype, index=i))
    return report
