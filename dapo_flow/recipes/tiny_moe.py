"""``builtin:tiny-moe``: a tiny Qwen3-MoE warm-started on ``a+b=`` to mixed accuracy, as tiny-adder.

The mixture-of-experts twin of ``builtin:tiny-adder``: the same character tokenizer (so it
learns the same task and reads tiny-adder's token ids), the same attention (hidden 64, 2 heads of
head_dim 32, 2 layers), and in place of each dense MLP a sparse block of ``num_experts`` experts
of which a learned top-k router sends every token to ``num_experts_per_tok`` (Qwen3-30B-A3B's
routing: softmax, top-k, the k weights renormalised; no shared expert). Each expert is half
tiny-adder's MLP wide, so a token's active MLP equals tiny-adder's and the total is twice it.
HF's Qwen3-MoE is dropless (every token reaches its k experts, no capacity factor), so no token
is ever dropped.

The warm start is tiny-adder's (:func:`tiny_adder.warm_start_on_sums`: label-smoothed teacher
forcing for a fixed number of steps, deterministic bytes); it trains without a load-balancing
loss, as tiny-adder's, so the router's balance is whatever the task made of it (the build
records it). Fewer steps than tiny-adder's: each step routes through an expert loop, slower
on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_flow.data.tasks import AdditionTask
from dapo_flow.recipes import tiny_adder
from dapo_flow.recipes.warm_start import deterministic_torch, save_model_dir, set_generation_config, write_build_info

RECIPE_VERSION = 1  # bump whenever the recipe (and so the bytes) changes: it names the cache dir


@dataclass(frozen=True)
class Recipe(tiny_adder.Recipe):
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128  # top-2 of 128: tiny-adder's 256 active per token
    router_aux_loss_coef: float = 0.001  # written to config.json (Qwen3-30B-A3B's); unused by the warm start
    steps: int = 1500


RECIPE = Recipe()


def shape_config(recipe: Recipe = RECIPE) -> dict[str, Any]:
    """The config.json keys that size the model (what ``graph.memory`` reads), known before it is built."""
    return {"model_type": "qwen3_moe", "vocab_size": tiny_adder.VOCAB_SIZE, "hidden_size": recipe.hidden_size,
            "head_dim": recipe.hidden_size // recipe.num_heads, "num_hidden_layers": recipe.num_layers,
            "num_attention_heads": recipe.num_heads, "num_key_value_heads": recipe.num_heads,
            "max_position_embeddings": recipe.max_position_embeddings, "tie_word_embeddings": False,
            # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (Mixtral's name)
            "num_local_experts": recipe.num_experts, "num_experts_per_tok": recipe.num_experts_per_tok,
            "moe_intermediate_size": recipe.moe_intermediate_size, "intermediate_size": recipe.intermediate_size,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def char_qwen3_moe(tokenizer: Any, recipe: Recipe) -> Any:
    """A fresh Qwen3MoeForCausalLM of ``recipe``'s shape for the character tokenizer; every
    layer sparse (``decoder_sparse_step`` 1), untied embeddings. Draws from torch's global
    generator: build it inside :func:`deterministic_torch`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = shape_config(recipe)
    del shape["model_type"]
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **{**shape, "vocab_size": len(tokenizer)},
        norm_topk_prob=True,  # Qwen3-30B-A3B's: the k routing weights sum to 1
        router_aux_loss_coef=recipe.router_aux_loss_coef,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3MoeForCausalLM"],
    ))


def build_tiny_moe(out_dir: Path, *, seed: int = 0, progress: bool = True, recipe: Recipe = RECIPE) -> Path:
    """Build, warm-start, save and evaluate the model into ``out_dir``; returns ``out_dir``."""
    from dapo_flow.models.tokenizer import build_char_tokenizer

    out_dir = Path(out_dir)
    task = AdditionTask()
    tokenizer = build_char_tokenizer(model_max_length=recipe.max_position_embeddings)
    start = time.perf_counter()
    with deterministic_torch(seed):
        model = char_qwen3_moe(tokenizer, recipe)
        tiny_adder.warm_start_on_sums(model, tokenizer, task, recipe, seed, progress, label="builtin:tiny-moe")
        set_generation_config(model, tokenizer)
        save_model_dir(out_dir, model, tokenizer)
        train_seconds = time.perf_counter() - start
        accuracy = tiny_adder.sampled_accuracy(out_dir, task, recipe)
    write_build_info(out_dir, name="tiny-moe", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=model, accuracy=accuracy, train_seconds=train_seconds,
                     protocol=f"{len(task.problems('val'))} val prompts x {recipe.eval_samples_per_prompt} "
                     f"samples, temperature 1.0, seed {recipe.eval_seed}")
    return out_dir
