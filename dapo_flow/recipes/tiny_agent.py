"""``builtin:tiny-agent``: a ~0.1M-parameter Llama warm-started on ``builtin:tool-arith`` to call a
calculator in some of its samples.

Two-digit products are beyond what this model can compute in its head, but copying ``a*b`` into
a call and the result back out is easy. The warm start mixes two kinds of demonstration
(``dapo_flow.data.tool_arith``): a fraction ``tool_fraction`` use the calculator (turn 1
``<call>calculator: a*b</call></s>``, the observation ``<result>P</result>`` with loss mask 0,
turn 2 ``P</s>``), the rest answer directly with the product. Which one a demonstration is does
not depend on the problem, so the first token's sampled choice settles near ``tool_fraction``:
sampled at temperature 1 the model calls the tool in a fraction of its samples (and is then
nearly always right) and otherwise guesses (nearly always wrong). RL then has groups with both
right and wrong samples and gains by calling the tool more often.

No label smoothing, unlike tiny-adder: a tool-using sample is ~36 trained tokens, and smoothing
spreads probability off every one of them (0.02 would lose about half the calls to typos).

As tiny-adder: fixed step count, fixed seeds, one thread and deterministic kernels make a
build's bytes identical on every build (same CPU type and torch version); Llama with head_dim
32 for vLLM's CPU attention; untied embeddings; heavy imports inside functions.
``sampled_tool_accuracy`` is a self-contained two-turn sampler for the build's figures (it
computes the call itself; the agent loop and the real calculator live elsewhere).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dapo_flow.data.tasks import Problem
from dapo_flow.data.tool_arith import ToolArithTask, call_text, observation_text, verify_tool_arith
from dapo_flow.recipes.warm_start import (  # noqa: F401 (BUILD_INFO: for callers)
    BUILD_INFO, char_llama, deterministic_torch, save_model_dir, set_generation_config, supervised_fit,
    write_build_info)

RECIPE_VERSION = 1  # bump whenever the recipe (and so the bytes) changes: it names the cache dir
# tiny-adder's characters (models/tokenizer.ARITHMETIC_CHARS, same ids) then what the compact
# tool-call format needs: "<call>calculator: 12*34</call>", "<result>408</result>" (and "error")
CHARS = "0123456789+= -" + "*<>/:" + "acelorstu"
VOCAB_SIZE = 4 + len(CHARS)  # <pad> <s> </s> <unk> first (models/tokenizer.py)


@dataclass(frozen=True)
class Recipe:
    hidden_size: int = 64
    num_heads: int = 2  # head_dim 32
    num_layers: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128  # prompt (7) + call turn (31) + result (21) + answer (5), twice over
    tool_fraction: float = 0.2  # demonstrations that call the calculator
    # Each step trains on tool-using rows only or direct rows only (half the steps each, weighed
    # back to the mixed-batch loss: warm_start.group_weights), so a batch of 12-token direct rows
    # is not padded to the 64 tokens of a tool-using one: 2000 steps in ~90 s on one core. The
    # number of steps that see tool rows is what makes calls reliable: 1000 at batch 32 give
    # ~94% right calls, where 500 at batch 64 (groups drawn by size) gave 85%.
    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    label_smoothing: float = 0.0
    eval_prompts: int = 500
    eval_samples_per_prompt: int = 8
    eval_max_tokens: int = 40  # per turn
    eval_seed: int = 1234


RECIPE = Recipe()


def shape_config(recipe: Recipe = RECIPE) -> dict[str, Any]:
    """The config.json keys that size the model (what ``graph.memory`` reads), known before the
    model is built: ``explain`` estimates memory without building anything."""
    return {"model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": recipe.hidden_size,
            "intermediate_size": recipe.intermediate_size, "num_hidden_layers": recipe.num_layers,
            "num_attention_heads": recipe.num_heads, "num_key_value_heads": recipe.num_heads,
            "max_position_embeddings": recipe.max_position_embeddings, "tie_word_embeddings": False}


def build_tokenizer(recipe: Recipe = RECIPE) -> Any:
    from dapo_flow.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer(CHARS, model_max_length=recipe.max_position_embeddings)


def build_tiny_agent(out_dir: Path, *, seed: int = 0, progress: bool = True, recipe: Recipe = RECIPE) -> Path:
    """Build, warm-start, save and evaluate the model into ``out_dir``; returns ``out_dir``."""

    out_dir = Path(out_dir)
    task = ToolArithTask()  # the same default splits `builtin:tool-arith` serves
    tokenizer = build_tokenizer(recipe)
    start = time.perf_counter()
    with deterministic_torch(seed):
        model = char_llama(tokenizer, recipe)
        demos = demonstrations(tokenizer, task.problems("train"), recipe.tool_fraction, seed)
        supervised_fit(model, [d.prompt_ids for d in demos], [d.response_ids for d in demos], recipe,
                       pad_id=tokenizer.pad_token_id, seed=seed, label="builtin:tiny-agent",
                       progress=progress, trim_padding=True, loss_masks=[d.loss_mask for d in demos],
                       groups=[int(d.uses_tool) for d in demos])
        set_generation_config(model, tokenizer)
        save_model_dir(out_dir, model, tokenizer)
        train_seconds = time.perf_counter() - start
        figures = sampled_tool_accuracy(out_dir, task.problems("val")[: recipe.eval_prompts],
                                        samples=recipe.eval_samples_per_prompt, seed=recipe.eval_seed,
                                        max_tokens=recipe.eval_max_tokens)
    write_build_info(out_dir, name="tiny-agent", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=model, accuracy=figures.accuracy_with_tools, train_seconds=train_seconds,
                     **{f"val_{k}": v for k, v in asdict(figures).items() if k != "accuracy_with_tools"},
                     protocol=f"first {recipe.eval_prompts} val prompts x {recipe.eval_samples_per_prompt} "
                     f"samples, temperature 1.0, at most {recipe.eval_max_tokens} tokens a turn, seed "
                     f"{recipe.eval_seed}; with the calculator (val_sampled_accuracy) and without it "
                     "(val_accuracy_without_tools: turn 1 is the whole response)")
    return out_dir


# --- demonstrations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Demonstration:
    """One warm-start row: the prompt (with BOS), the response as the agent loop lays it out,
    and its loss mask (1 on the model's tokens, 0 on the observation's)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]

    @property
    def uses_tool(self) -> bool:
        return 0 in self.loss_mask


def demonstration(tokenizer: Any, problem: Problem, *, use_tool: bool) -> Demonstration:
    """``use_tool``: enc(call) + [eos] + enc(observation) + enc(answer) + [eos], the
    observation masked; else enc(answer) + [eos]."""
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(problem.prompt, add_special_tokens=True)
    answer = enc(problem.answer) + [eos]
    if not use_tool:
        return Demonstration(prompt, answer, [1] * len(answer))
    call = enc(call_text(problem.prompt)) + [eos]
    observation = enc(observation_text(problem.answer))
    return Demonstration(prompt, call + observation + answer,
                         [1] * len(call) + [0] * len(observation) + [1] * len(answer))


def demonstrations(tokenizer: Any, problems: list[Problem], tool_fraction: float, seed: int) -> list[Demonstration]:
    """One demonstration per problem; which use the tool is a seeded draw, independent of the problem."""
    use_tool = np.random.default_rng(seed).random(len(problems)) < tool_fraction
    return [demonstration(tokenizer, p, use_tool=bool(t)) for p, t in zip(problems, use_tool)]


# --- the two-turn sampler ------------------------------------------------------------------

_CALL = re.compile(r"<call>calculator: (\d+)\*(\d+)</call>")


@dataclass(frozen=True)
class ToolFigures:
    """Sampled figures over all samples (fractions, 4 decimals)."""

    tool_call_rate: float  # turn 1 is a well-formed calculator call (the tool ran)
    accuracy_with_tools: float  # the final answer is right, the calculator available
    accuracy_without_tools: float  # turn 1 alone is right (a call is a wrong answer)
    tool_call_accuracy: float  # right among the samples that called the tool (0 when none did)


def calculator_call(turn_text: str) -> tuple[int, int] | None:
    """(a, b) when a model turn is exactly ``<call>calculator: a*b</call>``, else None."""
    match = _CALL.fullmatch(turn_text.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def sampled_tool_accuracy(model_dir: Path, problems: list[Problem], *, samples: int, seed: int,
                          max_tokens: int = 40) -> ToolFigures:
    """Sample ``samples`` responses per problem at temperature 1 with the calculator available:
    turn 1 until EOS; when it is a well-formed call (:func:`calculator_call`), append the
    observation ``<result>a*b</result>`` (Python's product) and sample turn 2 until EOS; any
    other turn 1 is the final response. Each response is verified with ``verify_tool_arith``."""
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    policy = HFPolicy(model_dir)
    tok = policy.tokenizer
    prompts = [tok.encode(p.prompt, add_special_tokens=True) for p in problems]
    first = policy.generate(prompts, SamplingConfig(n=samples, temperature=1.0, max_tokens=max_tokens, seed=seed))
    texts = tok.batch_decode(first.response_ids, skip_special_tokens=True)
    calls = [calculator_call(t) for t in texts]
    called = [i for i, c in enumerate(calls) if c is not None]
    observations = {i: tok.encode(observation_text(str(calls[i][0] * calls[i][1])), add_special_tokens=False)
                    for i in called}
    second_prompts = [prompts[first.prompt_index[i]] + first.response_ids[i] + observations[i] for i in called]
    second = (policy.generate(second_prompts, SamplingConfig(n=1, temperature=1.0, max_tokens=max_tokens,
                                                             seed=seed + 1)).response_ids if called else [])
    full = list(first.response_ids)
    for i, turn2 in zip(called, second):
        full[i] = first.response_ids[i] + observations[i] + turn2
    finals = tok.batch_decode(full, skip_special_tokens=True)
    truths = [problems[i].answer for i in first.prompt_index]
    with_tools = [verify_tool_arith(t, a) > 0 for t, a in zip(finals, truths)]
    without = [verify_tool_arith(t, a) > 0 for t, a in zip(texts, truths)]
    n = len(finals)
    return ToolFigures(
        tool_call_rate=round(len(called) / n, 4),
        accuracy_with_tools=round(sum(with_tools) / n, 4),
        accuracy_without_tools=round(sum(without) / n, 4),
        tool_call_accuracy=round(sum(with_tools[i] for i in called) / len(called), 4) if called else 0.0,
    )
