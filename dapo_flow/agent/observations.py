"""A round's tool responses as the tokens appended to a conversation.

- ``compact`` (the built-in models): ``<result>TEXT</result>`` per call, tokenized as plain text.
- ``hermes`` with a chat template (Qwen and the like): tool messages rendered by the template,
  exactly the text it puts between the model's turn and the next ``assistant`` header: the
  model ended its turn with EOS (e.g. ``<|im_end|>``), so what follows it in the template is
  the observation. Without a chat template: ``<tool_response>`` blocks as plain text.

Only observations are tokenized here; the model's own tokens are never re-tokenized.
"""

from __future__ import annotations

from typing import Any

from dapo_flow.tools.calls import CallFormat

_MARK = "\u2063TOOL{}\u2063"  # an invisible separator no template or tool text contains


class Observations:
    """``tokens(texts)``: the token ids of one round's tool responses to one request."""

    def __init__(self, fmt: CallFormat, tokenizer: Any, use_chat_template: bool):
        self.fmt, self.tokenizer = fmt, tokenizer
        self.chat = use_chat_template and getattr(tokenizer, "chat_template", None) is not None

    def text(self, texts: list[str], ended_with: str = "") -> str:
        """``ended_with``: the text of the turn's last token (its EOS, e.g. ``<|im_end|>``),
        which a chat template's observation would otherwise repeat."""
        if not self.chat:
            return "".join(self.fmt.render_text(t) for t in texts)
        wrapper = self._chat_wrapper(len(texts))
        if ended_with and wrapper.startswith(ended_with):
            wrapper = wrapper[len(ended_with):]
        for k, t in enumerate(texts):
            wrapper = wrapper.replace(_MARK.format(k), t)
        return wrapper

    def tokens(self, texts: list[str], ended_with: str = "") -> list[int]:
        return list(self.tokenizer.encode(self.text(texts, ended_with), add_special_tokens=False))

    def _chat_wrapper(self, count: int) -> str:
        """The template's text from after the model's answer to the next assistant header, with a
        mark where each tool message's content goes."""
        answer = "\u2063ANSWER\u2063"
        head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]
        tools = [{"role": "tool", "content": _MARK.format(k)} for k in range(count)]
        full = self.tokenizer.apply_chat_template(head + tools, tokenize=False, add_generation_prompt=True)
        return full[full.index(answer) + len(answer):]
