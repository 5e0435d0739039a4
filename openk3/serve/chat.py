"""Chat templates: OpenAI-style messages rendered into one prompt string with jinja2.

A checkpoint's template comes from ``chat_template.jinja`` or the ``chat_template`` entry of
``tokenizer_config.json`` and is rendered the way Hugging Face ``transformers`` does it (sandboxed
jinja2, ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson`` with ``json.dumps``'s ``ensure_ascii``, ``indent``,
``separators`` and ``sort_keys``, and ``{% generation %}`` blocks rendered as their body), with
``messages``, ``tools`` (the request's, or None), ``add_generation_prompt``, ``bos_token`` and
``eos_token`` in scope. (Kimi K2's template writes ``tools | tojson(separators=(',', ':'))``.)

Without one, ``DEFAULT_CHAT_TEMPLATE`` is used: ChatML, one block per message, then the opening
of the assistant's turn::

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    Hi!<|im_end|>
    <|im_start|>assistant

Images: each ``image_url`` content part is rendered as a slot string unique to the request
(the template sees plain text), and ``encode_with_images`` puts the image's block of token ids
in place of each slot, so the block sits exactly where the part was, whatever the template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template refused them, or it is broken)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """jinja2's ``tojson`` escapes HTML characters; chat templates want plain JSON."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with
    it (for training masks); rendering a prompt, it is its body."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _token_text(entry) -> str:
    """``bos_token`` / ``eos_token`` of a tokenizer_config: a string, or ``{"content": ...}``."""
    if isinstance(entry, dict):
        return entry.get("content", "")
    return entry or ""


class ChatTemplate:
    """A compiled chat template; ``render(messages)`` gives the prompt text."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _Generation])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: {e}") from e
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def __reduce__(self):  # compiled again where unpickled (a server process of api_servers.py)
        return ChatTemplate, (self.source, self.bos_token, self.eos_token)

    @classmethod
    def from_checkpoint(cls, *paths: str | Path) -> ChatTemplate:
        """The template stored in the first of the directories ``paths`` that holds one (a
        ``--tokenizer DIR`` before the checkpoint), or the default one."""
        for path in paths:
            path = Path(path)
            if path.is_file():  # --tokenizer DIR/tokenizer.json
                path = path.parent
            cfg_file = path / "tokenizer_config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            source = cfg.get("chat_template")
            if (path / "chat_template.jinja").exists():
                source = (path / "chat_template.jinja").read_text()
            elif isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t["name"]: t["template"] for t in source}
                source = named.get("default", next(iter(named.values()), None))
            if source:
                return cls(source, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
        return cls()

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """messages: ``[{"role": ..., "content": str, ...}, ...]``; tools: the request's tool
        declarations (OpenAI's ``tools``), which the template may write into the prompt. Raises
        ``ChatTemplateError``."""
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except Exception as e:  # the template is the checkpoint's code: any failure means bad messages
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e


def encode_with_images(text: str, slot: str, image_blocks: list[list[int]],
                       encode: Callable[[str], list[int]]) -> list[int]:
    """Token ids of a rendered prompt whose k-th ``slot`` stands for image k: the text between
    slots encoded piece by piece, ``image_blocks[k]`` in place of slot k. Raises
    ``ChatTemplateError`` when the template dropped or repeated a slot."""
    pieces = text.split(slot)
    if len(pieces) - 1 != len(image_blocks):
        raise ChatTemplateError(f"the chat template rendered {len(pieces) - 1} image slots for "
                                f"{len(image_blocks)} image_url parts (it must keep each part's "
                                "content in place, once)")
    ids = list(encode(pieces[0]))
    for block, piece in zip(image_blocks, pieces[1:]):
        ids += block + encode(piece)
    return ids
