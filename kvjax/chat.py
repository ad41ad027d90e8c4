"""A tokenizer's chat template around one user message: whether to use it, and the text before and after the message.

One rule for every caller that lays a prompt into a user turn: the eval's prompts, `kvjax.run`'s job lines, KVzip's
repeat prompt and KVzap's calibration prompt. The template is rendered once with a marker as the message (with the
assistant's opening, `add_generation_prompt=True`, and no reasoning trace, `enable_thinking=False`, which templates
other than hybrid-thinking ones ignore) and split at the marker.
"""

from __future__ import annotations

from typing import Any

from kvjax.errors import ConfigError

__all__ = ["CHAT_TEMPLATE_SETTINGS", "ChatTemplateError", "has_chat_template", "use_chat_template", "user_turn"]

#: The values of the CLIs' `--chat_template` flag.
CHAT_TEMPLATE_SETTINGS = ("auto", "yes", "no")
_MARKER = "\u0000KVJAX_SPLIT\u0000"


class ChatTemplateError(ConfigError):
    """The tokenizer's chat template cannot lay out a lone user message (it raises, or drops the message's text)."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (an instruction-tuned model's tokenizer does)."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template(tokenizer: Any, setting: str) -> bool:
    """`--chat_template`'s `setting` as a bool: "auto" when the tokenizer has a template, "yes", "no"; ConfigError for
    "yes" without a template or a setting outside `CHAT_TEMPLATE_SETTINGS`."""
    if setting not in CHAT_TEMPLATE_SETTINGS:
        raise ConfigError(f"--chat_template must be one of {', '.join(CHAT_TEMPLATE_SETTINGS)}, got {setting!r}")
    has = has_chat_template(tokenizer)
    if setting == "yes" and not has:
        raise ConfigError("--chat_template=yes but the tokenizer has no chat template")
    return has if setting == "auto" else setting == "yes"


def user_turn(tokenizer: Any) -> tuple[str, str]:
    """(before, after): the chat template's text before a user message, and after it up to the assistant's reply.

    ChatTemplateError when the template raises for a lone user message (jinja2's errors, or its own
    `raise_exception`) or leaves the message's text out; its message names the cause and no flag, for the caller
    to add what to do."""
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
    except Exception as e:  # noqa: BLE001 (the template's own errors, of any type)
        lines = str(e).strip().splitlines()
        raise ChatTemplateError(f"the tokenizer's chat template cannot render a user message ({type(e).__name__}: "
                                f"{lines[0] if lines else ''})") from None
    if not isinstance(rendered, str) or _MARKER not in rendered:
        raise ChatTemplateError("the tokenizer's chat template leaves out the user message's text")
    before, after = rendered.split(_MARKER, 1)
    return before, after
