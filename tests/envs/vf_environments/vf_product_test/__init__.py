"""vf-product-test: an offline verifiers (v1) environment for the tests, single-turn: the
taskset's ``count`` tasks ``a*b=`` (from ``first``), a harness that asks the model once (a chat
completion, no tools) in-process through verifiers' interception, and a rubric worth 0.5 when
the reply is the product (weight 0.5, so a reward of 1 would not be this rubric's)."""

from __future__ import annotations

from openai import AsyncOpenAI

import verifiers.v1 as vf


class ProductData(vf.TaskData):
    answer: str


class ProductConfig(vf.TasksetConfig):
    count: int = 4
    first: int = 11


class ProductTask(vf.Task[ProductData]):
    @vf.reward(weight=0.5)
    async def exact(self, task: ProductData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    def load(self):
        for k in range(self.config.count):
            a, b = self.config.first + k, 23 + 7 * k
            yield ProductTask(ProductData(prompt=f"{a}*{b}=", answer=str(a * b), id=f"p{k}"), self.config.task)


class OneTurnHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": data.prompt_text}], max_tokens=24)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ProductTaskset", "ProductTask", "OneTurnHarness"]
