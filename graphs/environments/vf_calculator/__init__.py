"""vf-calculator: a verifiers (v1) environment of the calculator task, written the way an
Environments Hub package is: a taskset (its rows: ``a*b=`` for two-digit a, b), a task whose
``@vf.reward`` grades the final reply, and a harness: a plain ``openai`` chat loop offering a
calculator tool. The harness runs in-process (verifiers' contract: every model call goes
through the interception ``endpoint`` with its ``secret``), so it needs no sandbox, no ``uv``
and no network. graphs/verifiers.yaml trains builtin:tiny-agent on it; its tool calls are the
built-in model's ``<call>calculator: a*b</call>``, which dapo-flow's endpoint serves as
``tool_calls``.

Loaded by id: ``vf-calculator`` (this folder on ``sys.path``; a Hub package is pip-installed).
"""

from __future__ import annotations

import json
import random
import re

import httpx
from openai import AsyncOpenAI

import verifiers.v1 as vf

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate a product of two integers, e.g. 12*34.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def calculate(expression: str) -> str:
    match = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", expression)
    return str(int(match.group(1)) * int(match.group(2))) if match else "error"


class CalculatorData(vf.TaskData):
    answer: str


class CalculatorConfig(vf.TasksetConfig):
    split: str = "train"
    """`train` or `val`: disjoint sets of operand pairs."""
    val_size: int = 500
    """Pairs held out for `val` (drawn first, with seed 0)."""
    max_turns: int = 3
    """Model turns per episode."""


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        """1 when the final reply is the product, else 0."""
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self):
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
        random.Random(0).shuffle(pairs)
        val = pairs[: self.config.val_size]
        chosen = val if self.config.split == "val" else pairs[self.config.val_size:]
        for a, b in chosen:
            yield CalculatorTask(CalculatorData(prompt=f"{a}*{b}=", answer=str(a * b)), self.config.task)


class CalculatorHarnessConfig(vf.HarnessConfig):
    max_turns: int = 3
    max_tokens: int = 40


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
    """The agent loop, in-process: chat completions with the calculator tool until a turn
    makes no call."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        # plain http on loopback: no TLS context to build (loading the CA bundle costs more than a turn)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             http_client=httpx.AsyncClient(verify=False, timeout=600))
        try:
            messages = [{"role": "user", "content": data.prompt_text}]
            for _ in range(self.config.max_turns):
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=[CALCULATOR], max_tokens=self.config.max_tokens)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    expression = json.loads(call.function.arguments or "{}").get("expression", "")
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CalculatorTaskset", "CalculatorTask", "CalculatorHarness"]
