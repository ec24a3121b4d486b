"""The chat-template path: a ChatML model (a short build of builtin:tiny-chat) over a real
``openai`` client; a two-request chat episode continues the sampled tokens exactly (the
template re-renders the assistant turn as sampled, <|im_end|> included), the user turn between
masked."""

from __future__ import annotations

import openai
import pytest

from dapo_flow.endpoint.server import Endpoint
from dapo_flow.models.hf import HFPolicy


@pytest.mark.slow  # builds a short tiny-chat (~10-30 s on a busy box)
def test_a_chat_episode_through_the_chat_template(short_tiny_chat_dir):
    policy = HFPolicy(short_tiny_chat_dir)
    tok = policy.tokenizer
    with Endpoint(policy, model_name="chat") as endpoint:
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.token, max_retries=0)
        endpoint.book.register("ep", seed=1, max_requests=4, budget=200)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        first = client.chat.completions.create(model="chat", messages=messages, max_tokens=12, user="ep")
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And 4+4?"}]
        client.chat.completions.create(model="chat", messages=messages, max_tokens=12, user="ep")
        record = endpoint.book.finish("ep")
    assert record.masked == "" and record.completions == 2
    expected_prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert tok.decode(record.prompt_ids) == expected_prompt
    between = [t for t, m in zip(record.response_ids, record.loss_mask) if m == 0]
    assert "And 4+4?" in tok.decode(between) and "<|im_start|>assistant" in tok.decode(between)
