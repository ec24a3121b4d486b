"""Tool responses as conversation tokens: compact text, or a chat template's tool messages
(exactly what the template puts after the model's turn, its EOS not repeated)."""

from __future__ import annotations

from dapo_flow.agent.observations import Observations
from dapo_flow.models.tokenizer import build_char_tokenizer
from dapo_flow.tools.calls import CALL_FORMATS


def test_compact_observations_are_result_blocks():
    tok = build_char_tokenizer("0123456789<>/abcdefghijklmnopqrstuvwxyz")
    obs = Observations(CALL_FORMATS["compact"], tok, use_chat_template=True)  # no template: plain text
    assert obs.text(["42", "7"]) == "<result>42</result><result>7</result>"
    assert obs.tokens(["42"]) == tok.encode("<result>42</result>", add_special_tokens=False)


def test_hermes_observations_follow_the_chat_template():
    from dapo_flow.recipes import tiny_chat
    from dapo_flow.recipes.chat_tokenizer import train_chat_tokenizer

    # tiny-chat's ChatML tokenizer, trained as its build trains it (seconds; no model needed)
    tok = train_chat_tokenizer(tiny_chat.corpus(tiny_chat.ChainTask()), vocab_size=tiny_chat.RECIPE.vocab_size,
                               model_max_length=tiny_chat.RECIPE.max_position_embeddings)
    obs = Observations(CALL_FORMATS["hermes"], tok, use_chat_template=True)
    # the model's turn ended with <|im_end|>: the template's newline, the tool turns, the next header
    assert obs.text(["R1", "R2"], ended_with="<|im_end|>") == (
        "\n<|im_start|>tool\nR1<|im_end|>\n<|im_start|>tool\nR2<|im_end|>\n<|im_start|>assistant\n")
    # a turn cut without its EOS gets the template's EOS from the observation
    assert obs.text(["R"]).startswith("<|im_end|>\n<|im_start|>tool\nR")
    plain = Observations(CALL_FORMATS["hermes"], tok, use_chat_template=False)
    assert plain.text(["R"]) == "<tool_response>\nR\n</tool_response>"
