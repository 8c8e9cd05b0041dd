"""Batch terms: the batched engine's step priced per concurrency, and its verify cost table against a measured one.

At concurrency c (every request decoding, `cache_len` keys cached each):

    AR      t_AR(c)     the target at batch c, one row each            tokens/s = c / t_AR(c)
    spec    t_draft(c)  the drafter's blocks of c requests
            t_verify(T) the target over T rows: c anchors + the drafts verified, about T / c a request
            tokens/s = (c + Σ_r E[accepted_r]) / (t_draft(c) + t_verify(T))

Verification turns compute-bound as T grows: a matmul's tensor FLOPs grow with its rows while its
weight bytes do not, so past some T (tens of rows at 8B on an H200) t_verify grows about linearly
(`compute_share` says how much of the verify's kernel time is bound by FLOPs). Without verify-budget
every request verifies its whole block (T = c · (k + 1)); with it T is chosen as the engine chooses
(runtime/batch_control.choose_verify_budget over survival alpha^j from the acceptance model, with
this model's verify times as the cost). Predicted, never measured: `compare_cost_table` sets a
measured table (runtime/batch.profile_step_cost's) beside the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..ir import Program
from ..runtime.batch_control import choose_verify_budget
from .acceptance import AcceptanceModel
from .gaps import draft_positions, step_ops
from .gpu import GPU, load_gpu
from .roofline import step_time

DEFAULT_CACHE_LEN = 512


def verify_ms(program: Program, gpu: GPU, batch: int, tokens: int, *, cache_len: int = DEFAULT_CACHE_LEN,
              dtype: str = "bfloat16", cuda_graphs: bool = False) -> float:
    """The target's forward over `tokens` rows of `batch` requests (about tokens / batch each), ms."""
    q = max(1, math.ceil(tokens / batch))
    est = step_time(program.target, gpu, batch, q, cache_len, dtype=dtype, cuda_graphs=cuda_graphs, what="verify")
    return 1e3 * est.time * tokens / (batch * q)


def compute_share(program: Program, gpu: GPU, batch: int, tokens: int, *, cache_len: int = DEFAULT_CACHE_LEN,
                  dtype: str = "bfloat16") -> float:
    """Of the verify's node times, the share where compute (FLOPs / rate) exceeds memory (bytes / bandwidth)."""
    q = max(1, math.ceil(tokens / batch))
    est = step_time(program.target, gpu, batch, q, cache_len, dtype=dtype, what="verify")
    total = sum(r.time for r in est.rows) or 1.0
    return sum(r.time for r in est.rows if r.t_compute > r.t_memory) / total


def verify_cost_table(program: Program, gpu: GPU, batch: int, tokens: Sequence[int], **kw) -> dict[int, float]:
    return {t: verify_ms(program, gpu, batch, t, **kw) for t in tokens}


def batch_rows(program: Program, gpu_name: str, sizes: Sequence[int], acceptance: AcceptanceModel, *,
               cache_len: int = DEFAULT_CACHE_LEN, dtype: str = "bfloat16") -> list[dict]:
    """Predicted tokens/s of batched AR and of the batched engine at each concurrency, with and
    without verify-budget, the verify's compute share, and the speedups over batched AR."""
    gpu = load_gpu(gpu_name)
    k = draft_positions(program)
    draft = step_ops(program)["draft"]
    survival, s = [], 1.0
    for a in (list(acceptance.alphas) + [acceptance.alphas[-1]] * k)[:k]:
        s *= a
        survival.append(s)
    rows = []
    for c in sizes:
        t_ar = 1e3 * step_time(program.target, gpu, c, 1, cache_len, dtype=dtype, what="ar").time
        t_draft = 1e3 * step_time(program.drafter, gpu, c, draft["block_size"], cache_len, dtype=dtype, what="draft",
                                  shared=program.target).time
        full_tokens = c * (k + 1)
        full = (c * (1 + sum(survival))) / (t_draft + verify_ms(program, gpu, c, full_tokens, cache_len=cache_len,
                                                                 dtype=dtype))
        per_q: dict[int, float] = {}  # a verify of T rows costs as c requests of ceil(T / c) rows, scaled to T

        def cost(t: int) -> float:
            q = max(1, math.ceil(t / c))
            if q not in per_q:
                per_q[q] = verify_ms(program, gpu, c, c * q, cache_len=cache_len, dtype=dtype)
            return per_q[q] * t / (c * q)
        choice = choose_verify_budget([survival] * c, cost, draft_ms=t_draft)
        budget_tokens = c + sum(choice.per_request)
        budget = choice.tokens_per_ms if budget_tokens > c else c / t_ar  # no drafts pay: an AR step
        ar = c / t_ar
        rows.append({"concurrency": c, "ar_step_ms": round(t_ar, 4), "draft_ms": round(t_draft, 4),
                     "verify_full_ms": round(verify_ms(program, gpu, c, full_tokens, cache_len=cache_len, dtype=dtype), 4),
                     "verify_full_compute_share": round(compute_share(program, gpu, c, full_tokens, cache_len=cache_len,
                                                                      dtype=dtype), 4),
                     "ar_tokens_per_s": round(1e3 * ar, 1), "spec_tokens_per_s": round(1e3 * full, 1),
                     "budget_tokens": budget_tokens, "budget_tokens_per_s": round(1e3 * budget, 1),
                     "speedup_full": round(full / ar, 4), "speedup_budget": round(budget / ar, 4)})
    return rows


def compare_cost_table(predicted: Mapping[int, float], measured: Mapping[int, float]) -> list[dict]:
    """The predicted verify times beside the measured ones, tokens by tokens: measured / predicted."""
    return [{"tokens": t, "predicted_ms": round(predicted[t], 4), "measured_ms": round(measured[t], 4),
             "measured_over_predicted": round(measured[t] / predicted[t], 4) if predicted[t] else None}
            for t in sorted(set(predicted) & set(measured))]
