"""The LLM proposer: any OpenAI-compatible endpoint, through the official `openai` client.

The model is shown the round's gap report (the cost model's ranked gaps and ceiling), the pass
catalogue (names, parameters, contracts, what each closes), the DSL grammar and the pipelines
already measured with their results, and asked for candidates in a fixed plain-text form:

    PIPELINE: draft-block-size{size=8},attention-split-kv
    RULES:
    pass my-pass (lossless) "what it does" { rule r: match ... set ... }
    END

Its answer is parsed as text into `Proposal`s and nothing else: every pipeline and rules text then
goes through `proposals.vet` like any other proposal. Nothing it returns is evaluated as Python.
An endpoint that fails or answers nonsense gives no proposals and a note; the search goes on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..grammar import grammar_text
from ..passes import REGISTRY
from .proposals import MAX_PIPELINE_CHARS, MAX_RULES_CHARS, Proposal

LLM = "llm"
MAX_ANSWER_CHARS = 20000
MAX_PROPOSALS = 8

SYSTEM = (
    "You tune speculative-decoding deployments for specpilot. Answer only with candidate pass pipelines "
    "in the form given; each line 'PIPELINE: <pipeline string>' may be followed by 'RULES:' and a rules "
    "text in the specpilot DSL ended by a line 'END'. Only lossless passes are tried; every output token "
    "of every candidate is checked by token forcing."
)


@dataclass(frozen=True)
class LLMConfig:
    url: str  # base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1
    model: str = "specpilot-proposer"
    api_key: str = "not-needed"
    timeout_s: float = 60.0
    max_tokens: int = 2000


def catalogue() -> str:
    lines = []
    for name, cls in sorted(REGISTRY.items()):
        params = ", ".join(f"{f.name.replace('_', '-')}: {f.type}" for f in cls.params()) or "no parameters"
        contract = "lossless" if cls.lossless else "lossy"
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(f"- {name} ({contract}; {params}): {doc} {('closes: ' + cls.closes) if cls.closes else ''}")
    return "\n".join(lines)


def prompt(gap_report: str, tried: list[tuple[str, str]]) -> str:
    done = "\n".join(f"- {p or '(empty)'}: {r}" for p, r in tried[-20:]) or "- (none yet)"
    return (f"## Gap report (cost model)\n{gap_report}\n\n## Pass catalogue\n{catalogue()}\n\n"
            f"## DSL grammar (lark)\n{grammar_text('specpilot.lark')}\n\n## Tried so far\n{done}\n\n"
            f"Propose up to {MAX_PROPOSALS} new candidates.")


def parse_answer(text: str, source: str) -> list[Proposal]:
    """The PIPELINE/RULES/END blocks of an answer as proposals (text only; vetting comes later)."""
    text = text[:MAX_ANSWER_CHARS]
    out: list[Proposal] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines) and len(out) < MAX_PROPOSALS:
        m = re.match(r"\s*PIPELINE:\s*(.*)$", lines[i])
        i += 1
        if not m:
            continue
        pipeline = m.group(1).strip().strip("`")[:MAX_PIPELINE_CHARS + 1]
        rules: tuple[tuple[str, str], ...] = ()
        if i < len(lines) and lines[i].strip() == "RULES:":
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "END":
                body.append(lines[i])
                i += 1
            i += 1
            rules = ((f"{source} #{len(out)}", "\n".join(body)[:MAX_RULES_CHARS + 1]),)
        out.append(Proposal(pipeline, LLM, rules, note=f"from {source}", family=LLM))
    return out


def llm_proposals(config: LLMConfig, gap_report: str, tried: list[tuple[str, str]]) -> tuple[list[Proposal], str]:
    """Ask the endpoint; (proposals, a note on what happened)."""
    from openai import OpenAI, OpenAIError

    client = OpenAI(base_url=config.url, api_key=config.api_key, timeout=config.timeout_s, max_retries=0)
    try:
        answer = client.chat.completions.create(
            model=config.model, max_tokens=config.max_tokens,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(gap_report, tried)}])
    except OpenAIError as e:
        return [], f"LLM proposer at {config.url}: {type(e).__name__}: {str(e)[:200]}"
    content = (answer.choices[0].message.content or "") if answer.choices else ""
    found = parse_answer(content, f"llm {config.model}")
    return found, f"LLM proposer at {config.url}: {len(found)} proposals"
