"""Chat messages -> prompt text: the model's own chat template when it has one, else a plain turn format.

The plain format (PLAIN_TURNS) is for targets without a chat template (base models, the test models): each
message becomes one paragraph led by its role, and the text ends with "Assistant:" so that the model's
continuation is the reply. For example [{"role": "user", "content": "Hi"}] renders as

    User: Hi

    Assistant:

(no space after the final colon: a tokenizer then keeps the reply's first word with its own leading space).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# role -> how one message of that role is written; the generation prompt ends the text.
PLAIN_TURNS = {
    "system": "System: {content}\n\n",
    "user": "User: {content}\n\n",
    "assistant": "Assistant: {content}\n\n",
}
PLAIN_GENERATION_PROMPT = "Assistant:"


def render_plain(messages: Sequence[dict[str, str]]) -> str:
    """The messages in the plain turn format (PLAIN_TURNS), ending with the generation prompt "Assistant:".

    Raises ValueError for a role outside system/user/assistant or content that is not a string.
    """
    parts = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in PLAIN_TURNS:
            raise ValueError(f"messages[{index}] has role {role!r}: the plain turn format knows {', '.join(PLAIN_TURNS)}; use one of them")
        if not isinstance(content, str):
            raise ValueError(f"messages[{index}].content is a {type(content).__name__}: give the message's text as a string")
        parts.append(PLAIN_TURNS[role].format(content=content))
    return "".join(parts) + PLAIN_GENERATION_PROMPT


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a non-empty chat template (Hugging Face `chat_template`)."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """Prompt text for chat messages: the tokenizer's chat template with the generation prompt added when it has
    one, else render_plain. The template's own errors (e.g. roles that must alternate) propagate unchanged, so a
    server can answer them as a rejected request."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return render_plain(messages)


def render_for_completions(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """render() as text for /v1/completions: without a leading BOS that the template writes and the completion
    endpoint adds again when it tokenizes, so a chat request sent this way reaches every engine as the same tokens
    that the specgate server's /v1/chat/completions makes of it."""
    text = render(tokenizer, messages)
    bos = getattr(tokenizer, "bos_token", None) if has_chat_template(tokenizer) else None
    return text[len(bos):] if bos and text.startswith(bos) else text
