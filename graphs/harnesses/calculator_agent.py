"""A plain `openai` client loop playing the calculator task (builtin:tool-arith): the harness of
graphs/harness.yaml. Nothing in it knows about dapo-flow: it offers a calculator tool, runs the
calls the model makes, sends the results back, and grades the final answer itself.

    run(client, task): client is an openai.AsyncOpenAI pointed at the endpoint, task the prompt row
    ({"prompt_text": "12*34=", "ground_truth": "408", ...}); returns the reward.
"""

import json
import re

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a product of two integers, e.g. 12*34.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    match = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", expression)
    return str(int(match.group(1)) * int(match.group(2))) if match else "error"


async def run(client, task):
    messages = [{"role": "user", "content": task["prompt_text"]}]
    model = (await client.models.list()).data[0].id
    for _ in range(3):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                     max_tokens=40)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    answer = (message.content or "").strip()
    return 1.0 if answer == task["ground_truth"] else -1.0
