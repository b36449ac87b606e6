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
        """Token ids; `add_special_tokens` adds what the tokenizer adds around a text (e.g. BOS): what
        /v1/completions and /tokenize do to a string prompt by default, as vLLM (a chat template writes its own)."""
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


MAX_TEMPLATE_ITEMS = 1 << 20  # longest string or list a template may build with `*`
MAX_TEMPLATE_POWER = 64  # largest exponent a template may use with `**`


class TemplateRenderError(ValueError):
    """A chat template failed on these messages / variables (the request's fault: a 400)."""


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

    class Env(ImmutableSandboxedEnvironment):
        # Request values reach the template (messages, chat_template_kwargs): bound what `*` and `**` can build.
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int | float) and abs(right) > MAX_TEMPLATE_POWER:
                raise jinja2.exceptions.SecurityError(f"exponent {right} is too large")
            if operator == "*":
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(k, int) and len(seq) * k > MAX_TEMPLATE_ITEMS:
                        raise jinja2.exceptions.SecurityError("a repeated string or list would be too long")
            return super().call_binop(context, operator, left, right)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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

    def render(self, messages: Sequence[dict], **template_kwargs) -> str:
        """The prompt text: the template over `messages` with the assistant's generation prompt appended (unless
        `add_generation_prompt=False`); `template_kwargs` are further template variables (vLLM's
        `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""
        variables = {"add_generation_prompt": True, **template_kwargs, "messages": list(messages), **self._special}
        try:
            return self._compiled.render(**variables)
        except MemoryError:
            raise
        except Exception as e:  # whatever the template does with request values (raise_exception, 1/0, ...)
            raise TemplateRenderError(f"{type(e).__name__}: {e}") from None

    def __call__(self, messages: Sequence[dict], **template_kwargs) -> list[int]:
        return self._encode(self.render(messages, **template_kwargs))
