"""``builtin:tiny-adder-teacher``: ``builtin:tiny-adder`` trained longer, a teacher to distill from.

The same architecture and tokenizer (so its logprobs score the student's token ids as they
are), warm-started from tiny-adder's weights and trained on for a fixed number of steps without
label smoothing: tiny-adder's smoothing (0.27) is what leaves its samples mostly wrong on
purpose (RL needs headroom); without it the same network samples the right sum most of the time.
Deterministic (fixed seeds, one thread, a fixed step count) and cached like the other builtins;
the build takes about a minute on one core once tiny-adder is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_flow.data.tasks import AdditionTask
from dapo_flow.recipes import tiny_adder
from dapo_flow.recipes.warm_start import deterministic_torch, save_model_dir, write_build_info

# follows the student's recipe: a new tiny-adder is a new teacher
RECIPE_VERSION = 100 * tiny_adder.RECIPE_VERSION + 1


@dataclass(frozen=True)
class Recipe(tiny_adder.Recipe):
    steps: int = 1500  # on top of tiny-adder's 2500
    lr: float = 1e-3
    warmup_steps: int = 20
    label_smoothing: float = 0.0


RECIPE = Recipe()


def shape_config() -> dict[str, Any]:
    """tiny-adder's shape: the teacher is the same network, trained longer."""
    return tiny_adder.shape_config()


def build_tiny_adder_teacher(out_dir: Path, *, seed: int = 0, progress: bool = True, recipe: Recipe = RECIPE) -> Path:
    """tiny-adder's weights, ``recipe.steps`` more supervised steps, saved and evaluated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_flow.models import resolve_model

    out_dir = Path(out_dir)
    student_dir = resolve_model("builtin:tiny-adder", progress=progress)
    task = AdditionTask()
    start = time.perf_counter()
    with deterministic_torch(seed):
        tokenizer = AutoTokenizer.from_pretrained(student_dir)
        model = AutoModelForCausalLM.from_pretrained(student_dir)
        # a seed of its own: the student's warm start drew its batches from `seed` already
        tiny_adder.warm_start_on_sums(model, tokenizer, task, recipe, seed + 1, progress,
                                      label="builtin:tiny-adder-teacher")
        save_model_dir(out_dir, model, tokenizer)
        train_seconds = time.perf_counter() - start
        accuracy = tiny_adder.sampled_accuracy(out_dir, task, recipe)
    write_build_info(out_dir, name="tiny-adder-teacher", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=model, accuracy=accuracy, train_seconds=train_seconds, student="builtin:tiny-adder",
                     protocol=f"{len(task.problems('val'))} val prompts x {recipe.eval_samples_per_prompt} "
                     f"samples, temperature 1.0, seed {recipe.eval_seed}")
    return out_dir
