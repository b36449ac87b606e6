"""Text ↔ token ids for the server: a uniform tokenizer interface and chat-template rendering.

The server needs two things from a tokenizer: `encode(text) -> list[int]` (no BOS/EOS added: the chat
template writes its own special tokens) and `decode(ids) -> str` (special tokens skipped). `TokenizerAdapter`
gives that interface to a `tokenizers.Tokenizer` or a transformers tokenizer (what `dspark_jax` loads);
any other object with those two methods is used as it is.

`ChatFormatter` renders OpenAI-style messages with a model's jinja chat template (from the GGUF's
`tokenizer.chat_template` or `tokenizer_config.json`, see `dspark_jax.gguf_file.load_tokenizer`) with
`add_generation_prompt=True`, in a sandboxed jinja environment set up like transformers'
`apply_chat_template`, and tokenizes the result: `formatter(messages) -> list[int]`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TokenizerAdapter:
    """`encode`/`decode` over a `tokenizers.Tokenizer` or a transformers tokenizer.

    Both accept `add_special_tokens` and `skip_special_tokens`; `tokenizers` returns an `Encoding` (its
    `.ids` are the ids) where transformers returns the list itself.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids; `add_special_tokens` adds what the tokenizer adds around a text (e.g. BOS): only for
        /tokenize's flag, never for prompts (the server's prompts are encoded without them)."""
        out = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in getattr(out, "ids", out)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def as_text_tokenizer(tokenizer) -> TextTokenizer:
    """Wraps a `tokenizers.Tokenizer` or transformers tokenizer; returns anything else unchanged."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer | TokenizerAdapter):
        return tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)
    # transformers tokenizers (slow or fast) all have this; checked by attribute so that transformers,
    # slow to import, is not imported here.
    if hasattr(tokenizer, "apply_chat_template"):
        return TokenizerAdapter(tokenizer)
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no encode/decode methods")
    return tokenizer


def _sandbox(template: str):
    """Compiles a chat template in an immutable sandbox with the helpers Hub templates expect."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not want.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatFormatter:
    """Renders messages with a jinja chat template and tokenizes them.

    Args:
      template: the jinja source (`tokenizer.chat_template`).
      encode: text -> token ids, adding no special tokens (the template writes them).
      bos_token, eos_token: the strings templates may reference as `bos_token` / `eos_token`.
    """

    def __init__(self, template: str, encode: Callable[[str], list[int]], *, bos_token: str = "",
                 eos_token: str = ""):
        if not template:
            raise ValueError("empty chat template; chat completions need a chat/instruct model")
        self.template = template
        self._compiled = _sandbox(template)
        self._encode = encode
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatFormatter:
        """From a transformers tokenizer that carries `chat_template` (what `load_tokenizer` returns)."""
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
        return cls(template, as_text_tokenizer(tokenizer).encode,
                   bos_token=getattr(tokenizer, "bos_token", None) or "",
                   eos_token=getattr(tokenizer, "eos_token", None) or "")

    def render(self, messages: Sequence[dict]) -> str:
        """The prompt text: the template over `messages` with the assistant's generation prompt appended."""
        return self._compiled.render(messages=list(messages), add_generation_prompt=True, **self._special)

    def __call__(self, messages: Sequence[dict]) -> list[int]:
        return self._encode(self.render(messages))
