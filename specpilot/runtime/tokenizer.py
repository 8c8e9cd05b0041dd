"""Tokenizers: a deterministic byte-level tokenizer for tiny test models, loading tokenizer.json, and
chat templates.

Chat messages -> prompt text: a model directory's tokenizer_config.json may carry a Jinja
`chat_template` (Hugging Face's convention), rendered in Jinja's sandbox as transformers does
(messages, add_generation_prompt=True, bos_token, eos_token, raise_exception). A tokenizer without
one (the zoo's code models) gets PLAIN_TEMPLATE: each message as "<role>: <content>" on its own
line, then "assistant:". The server's chat endpoint and the chat prompt sets both render through it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from specpilot.errors import CheckpointError


def byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte 0..255 (GPT-2 byte-level mapping), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_byte_tokenizer(special_tokens: list[str]) -> Tokenizer:
    """Byte-level BPE without merges: token id = byte value (0..255), then the specials in order (256..)."""
    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special_tokens])
    return tok


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing tokenizer.json (expected a Hugging Face tokenizers file)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exceptions with a parse message
        raise CheckpointError(f"{path}: not a valid tokenizer.json: {e}") from None


def chat_template(model_dir: str | Path) -> str | None:
    """The chat template of a model directory's tokenizer_config.json (None where it has none)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a JSON object with a 'chat_template' string ({e})") from None
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: field 'chat_template' is not a string (one Jinja template expected)")
    return template


def chat_prompt(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                **variables: str) -> str:
    """`messages` ([{"role", "content"}, ...]) rendered by a model's Jinja chat template, in a sandbox
    (a template is data from a model file, never trusted code), as transformers' apply_chat_template does:
    `variables` (bos_token, eos_token) and `raise_exception` (a jinja2.TemplateError: the template
    refuses the conversation) are what templates may use besides."""
    return compiled_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **variables)


@functools.lru_cache(maxsize=8)
def compiled_template(template: str):
    """A chat template compiled once in a sandboxed environment (a prompt set renders hundreds)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


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


def token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def load_chat_template(model_dir: Path | None) -> ChatTemplate:
    """The chat template of the tokenizer in `model_dir` (its tokenizer_config.json), else (or with no
    directory) the plain one; a CheckpointError naming the file where that is malformed."""
    template = chat_template(model_dir) if model_dir is not None else None
    if not template:
        return ChatTemplate("plain", PLAIN_TEMPLATE)
    path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))  # chat_template() has parsed it: a JSON object
    return ChatTemplate(str(path), template, token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token")))
