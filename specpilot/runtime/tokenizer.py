"""Tokenizers: a deterministic byte-level tokenizer for tiny test models, and loading tokenizer.json."""

from __future__ import annotations

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
    import json

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
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **variables)
