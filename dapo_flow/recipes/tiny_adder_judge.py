"""``builtin:tiny-adder-judge``: a generative verifier for ``builtin:tiny-adder``'s answers.

A causal LM trained on the right answers of the train split (teacher forcing on ``a+b=`` ->
sum + EOS, as tiny-adder's warm start, but 4 layers, no label smoothing and 1500 steps at twice
its rate, so it is sharp where the policy is kept soft). It judges a response by the lowest probability it gives
any of the response's tokens (``score`` with ``reward: {model: judge, output: likelihood}``): a
wrong digit, a missing EOS or a stray token gets almost none. A sequence classifier must recompute
the sum at the response's last token; this judge checks each token at the position where it would
have written it, which is why it verifies where builtin:tiny-adder-rm cannot (docs/results.md: "A learned
reward model, a generative verifier" has both figures).

Its build info records its own sampled accuracy and, with the protocol builtin:tiny-adder-rm's
build uses (500 val prompts x 4 tiny-adder samples), how often its verdict (lowest token
probability > 0.5) is the rule verifier's. Fixed seeds, one thread and deterministic kernels make
the bytes the same on every build of a CPU type; it takes under 2 minutes of one core.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dapo_flow.data.tasks import AdditionTask
from dapo_flow.recipes import tiny_adder, tiny_adder_rm

# its agreement figure is measured on tiny-adder's samples: a new tiny-adder is a new build
RECIPE_VERSION = 100 * tiny_adder.RECIPE_VERSION + 4

# tiny-adder's recipe with twice the layers, a larger rate and no label smoothing: the policy's
# smoothing leaves it soft for RL's sake, a verifier has to be sure
RECIPE = replace(tiny_adder.RECIPE, num_layers=4, steps=1500, lr=2e-3, warmup_steps=30, label_smoothing=0.0,
                 eval_samples_per_prompt=4)


def shape_config() -> dict[str, Any]:
    """The config.json keys that size the model, known before it is built."""
    return tiny_adder.shape_config(RECIPE)


def build_tiny_adder_judge(out_dir: Path, *, seed: int = 0, progress: bool = True,
                           recipe: tiny_adder.Recipe = RECIPE) -> Path:
    """Train, save and evaluate the judge into ``out_dir``; returns ``out_dir``."""
    from dapo_flow.models import resolve_model
    from dapo_flow.models.tokenizer import build_char_tokenizer
    from dapo_flow.recipes.warm_start import (char_llama, deterministic_torch, save_model_dir,
                                                     set_generation_config, write_build_info)

    out_dir = Path(out_dir)
    task = AdditionTask()
    policy_dir = resolve_model("builtin:tiny-adder", progress=progress)
    tokenizer = build_char_tokenizer(model_max_length=recipe.max_position_embeddings)
    start = time.perf_counter()
    with deterministic_torch(seed):
        model = char_llama(tokenizer, recipe)
        tiny_adder.warm_start_on_sums(model, tokenizer, task, recipe, seed, progress, label="builtin:tiny-adder-judge")
        set_generation_config(model, tokenizer)
        save_model_dir(out_dir, model, tokenizer)
        train_seconds = time.perf_counter() - start
        accuracy = tiny_adder.sampled_accuracy(out_dir, task, recipe)
        rm_recipe = tiny_adder_rm.RECIPE
        agreement = tiny_adder_rm.agreement_with_rule(
            judge_verdicts(out_dir), policy_dir, task.problems("val")[: rm_recipe.val_prompts],
            rm_recipe.samples_per_prompt, rm_recipe.eval_seed)
    write_build_info(out_dir, name="tiny-adder-judge", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=model, accuracy=accuracy, train_seconds=train_seconds,
                     protocol=f"{len(task.problems('val'))} val prompts x {recipe.eval_samples_per_prompt} "
                     f"samples, temperature 1.0, seed {recipe.eval_seed}",
                     agreement_protocol=f"its verdict (lowest token probability > 0.5) against the rule verifier "
                     f"on {rm_recipe.val_prompts} val prompts x {rm_recipe.samples_per_prompt} tiny-adder samples "
                     f"(temperature 1, seed {rm_recipe.eval_seed})", **agreement)
    return out_dir


def judge_verdicts(judge_dir: Path):
    """``verdicts(prompt_ids, response_ids)``: the judge's bool verdict on each response, as
    ``score`` with ``output: likelihood`` reads it (its lowest token probability > 0.5)."""
    from dapo_flow.algos import lowest_token_probability
    from dapo_flow.models.hf import HFPolicy

    judge = HFPolicy(judge_dir)

    def verdicts(prompt_ids: list[list[int]], response_ids: list[list[int]]):
        logp, _, mask = judge.response_logprobs(prompt_ids, response_ids)
        return lowest_token_probability(logp, mask) > 0.5

    return verdicts
