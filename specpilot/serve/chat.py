"""Chat messages -> prompt text: the tokenizer's chat template, else a documented plain one.

A model directory's tokenizer_config.json may carry a Jinja `chat_template` (Hugging Face's
convention); runtime/tokenizer.py reads it and renders it in Jinja's sandbox as transformers does
(messages, add_generation_prompt=True, bos_token, eos_token, raise_exception). A tokenizer without
one (the zoo's code models) gets PLAIN_TEMPLATE: each message as "<role>: <content>" on its own
line, then "assistant:".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..runtime.tokenizer import chat_prompt, chat_template

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the file the template came from, or "plain" (PLAIN_TEMPLATE)
    text: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict]) -> str:
        """The prompt text; jinja2.TemplateError where the template refuses the conversation."""
        return chat_prompt(self.text, messages, bos_token=self.bos_token, eos_token=self.eos_token)


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def load_chat_template(model_dir: Path) -> ChatTemplate:
    """The chat template of the tokenizer in `model_dir` (its tokenizer_config.json), else the plain one;
    a CheckpointError naming the file where that is malformed."""
    template = chat_template(model_dir)
    if not template:
        return ChatTemplate("plain", PLAIN_TEMPLATE)
    path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))  # chat_template() has parsed it: a JSON object
    return ChatTemplate(str(path), template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
