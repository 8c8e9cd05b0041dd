"""Chat messages -> prompt text: the tokenizer's chat template, else a documented plain one.

A model directory's tokenizer_config.json may carry a Jinja `chat_template` (Hugging Face's
convention); it is rendered in Jinja's sandbox as transformers renders it (messages,
add_generation_prompt=True, bos_token, eos_token). A tokenizer without one (the zoo's code models)
gets PLAIN_TEMPLATE: each message as "<role>: <content>" on its own line, then "assistant:".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import EngineError

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the file the template came from, or "plain" (PLAIN_TEMPLATE)
    text: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict]) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise  # what transformers gives templates to refuse a conversation
        return env.from_string(self.text).render(messages=messages, add_generation_prompt=True,
                                                 bos_token=self.bos_token, eos_token=self.eos_token)


def _raise(message: str):
    raise TemplateError(message)


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def load_chat_template(model_dir: Path) -> ChatTemplate:
    """The chat template of the tokenizer in `model_dir` (its tokenizer_config.json), else the plain one."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return ChatTemplate("plain", PLAIN_TEMPLATE)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: not valid JSON ({e.msg})") from None
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: HF picks "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) or not template:
        return ChatTemplate("plain", PLAIN_TEMPLATE)
    return ChatTemplate(str(path), template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
