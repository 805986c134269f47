"""Prompt formats: how a task's question becomes the prompt text the policy completes.

- ``plain``: a template with ``{question}`` (``data.prompt_template``, default
  ``"Question: {question}\\nAnswer:"``), for base models.
- ``chat``: the tokenizer's own chat template, ``tokenizer.apply_chat_template(messages,
  add_generation_prompt=True)`` with an optional system message (``data.system_prompt``) and
  the template's options (``data.chat_template_kwargs``, e.g. ``{enable_thinking: true}``), for
  instruct and thinking models.

`prompt_renderer` gives what the task builders (`rltt.orchestration.prompt_stream.make_task`) take:
the plain template string itself, or a `ChatPrompt` callable — so training, evaluation and
curation render prompts the same way. The rendered text is tokenized without added special
tokens (a chat template writes its own BOS, if any).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

from rltt.errors import RlttError

PROMPT_FORMATS = ("plain", "chat")

# what make_task accepts: a {question} template, or a callable question -> prompt text
PromptRenderer = Union[str, Callable[[str], str]]


@dataclass
class ChatPrompt:
    """``question -> prompt text`` through ``tokenizer``'s chat template (generation prompt added).

    ``str()`` of it is the template rendered for the question ``"{question}"``: a stable
    description of the format (curation records it in its settings digest)."""

    tokenizer: Any
    system_prompt: str | None = None
    options: dict = field(default_factory=dict)

    def messages(self, question: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": question}]

    def __call__(self, question: str) -> str:
        try:
            text = self.tokenizer.apply_chat_template(self.messages(question), tokenize=False,
                                                      add_generation_prompt=True, **self.options)
        except Exception as exc:  # noqa: BLE001 - a template/option error, reported in one line
            raise RlttError(f"data.chat_template_kwargs: the tokenizer's chat template failed "
                            f"({type(exc).__name__}: {exc})") from None
        if not isinstance(text, str):
            raise RlttError(f"data.prompt_format: the chat template returned {type(text).__name__}, not text")
        return text

    def __str__(self) -> str:
        return "chat:" + self("{question}")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_renderer(prompt_format: str, tokenizer=None, template: str = "Question: {question}\nAnswer:",
                    system_prompt: str | None = None, options: dict | None = None) -> PromptRenderer:
    """The renderer of ``prompt_format``: ``template`` (plain) or a checked `ChatPrompt` (chat)."""
    if prompt_format == "plain":
        if system_prompt:
            raise RlttError("data.system_prompt: needs data.prompt_format: chat (a plain template has no "
                            "system message; write it into data.prompt_template)")
        return template
    if prompt_format != "chat":
        raise RlttError(f"data.prompt_format: must be one of {' | '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if tokenizer is None or not has_chat_template(tokenizer):
        raise RlttError("data.prompt_format: chat needs a tokenizer with a chat template, and this model's "
                        "tokenizer has none (use data.prompt_format: plain, or a checkpoint whose "
                        "tokenizer_config.json sets chat_template)")
    chat = ChatPrompt(tokenizer, system_prompt, dict(options or {}))
    chat("{question}")  # a template or option error fails here, before any work
    return chat


def recipe_prompt_renderer(data, tokenizer) -> PromptRenderer:
    """`prompt_renderer` of a recipe's ``data`` section (``prompt_format``, ``prompt_template``,
    ``system_prompt``, ``chat_template_kwargs``)."""
    return prompt_renderer(getattr(data, "prompt_format", "plain"), tokenizer, data.prompt_template,
                           getattr(data, "system_prompt", None), getattr(data, "chat_template_kwargs", None))
