"""``builtin:tiny-chat``: a small Qwen2 chat model with a byte-level BPE tokenizer, warm-started
on ``builtin:chain`` to mixed accuracy.

The model a user would download, in miniature: Qwen2ForCausalLM with grouped-query attention
(2 query heads per KV head), a ~4k-token byte-level BPE vocabulary trained locally
(``chat_tokenizer``), ChatML in the tokenizer config, ``<|im_end|>`` as EOS and an embedding
padded past the tokenizer's size. It is written as a plain Hugging Face directory, loadable with
AutoModelForCausalLM / AutoTokenizer and vLLM. Sizes are cut to what 2 CPU cores train in
minutes (hidden 128, not ~256): the same code paths at a tenth of the compute.

As with tiny-adder, the supervised warm start runs a FIXED number of steps with label smoothing
so that sampled accuracy lands in the band RL can improve (groups with right and wrong samples),
and fixed seeds, one thread and deterministic kernels make a build reproducible on the same CPU
type, Python and torch versions (the BPE corpus includes Python's bundled documentation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_flow.data.chain_task import ChainTask, question, solution, verify_chain
from dapo_flow.recipes.warm_start import (  # noqa: F401 (BUILD_INFO: for callers)
    BUILD_INFO, deterministic_torch, sampled_accuracy_of, save_model_dir, supervised_fit, write_build_info)

RECIPE_VERSION = 2  # bump whenever the recipe (and so the bytes) changes: it names the cache dir


@dataclass(frozen=True)
class Recipe:
    vocab_size: int = 4096  # BPE tokens, specials included
    padded_vocab_size: int = 4160  # the embedding's rows: a multiple of 64 past the tokenizer, as Qwen2 pads
    hidden_size: int = 128
    num_heads: int = 2  # head_dim 64, one of the sizes vLLM's CPU attention takes
    num_kv_heads: int = 1  # grouped-query attention, 2 query heads per KV head
    num_layers: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    # 1200 steps of 16 rows land sampled accuracy at ~0.27 in a fifth of the compute 800 of 64
    # took (0.35): rows, not steps, were the cost, and RL only needs the mixed band
    steps: int = 1200
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    label_smoothing: float = 0.04
    eval_prompts: int = 200
    eval_samples_per_prompt: int = 4
    eval_max_tokens: int = 40
    eval_seed: int = 1234


RECIPE = Recipe()


def shape_config(recipe: Recipe = RECIPE) -> dict[str, Any]:
    """The config.json keys that size the model, known before it is built (for ``explain``)."""
    return {"model_type": "qwen2", "vocab_size": recipe.padded_vocab_size, "hidden_size": recipe.hidden_size,
            "intermediate_size": recipe.intermediate_size, "num_hidden_layers": recipe.num_layers,
            "num_attention_heads": recipe.num_heads, "num_key_value_heads": recipe.num_kv_heads,
            "max_position_embeddings": recipe.max_position_embeddings, "tie_word_embeddings": False}


def corpus(task: ChainTask) -> list[str]:
    """The BPE training text: Python's bundled reference documentation (general English and
    code, ~0.5 MB) and the chain task's train transcripts in ChatML."""
    import pydoc_data.topics

    chats = [f"<|im_start|>user\n{question(p.prompt)}<|im_end|>\n<|im_start|>assistant\n"
             f"{solution(p.prompt)}<|im_end|>\n" for p in task.problems("train")]
    return [*pydoc_data.topics.topics.values(), *chats]


def build_tiny_chat(out_dir: Path, *, seed: int = 0, progress: bool = True, recipe: Recipe = RECIPE) -> Path:
    """Train the tokenizer, build, warm-start, save and evaluate the model into ``out_dir``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from dapo_flow.recipes.chat_tokenizer import train_chat_tokenizer

    out_dir = Path(out_dir)
    task = ChainTask()  # the default splits `builtin:chain` serves
    start = time.perf_counter()
    tokenizer = train_chat_tokenizer(corpus(task), vocab_size=recipe.vocab_size,
                                     model_max_length=recipe.max_position_embeddings)
    with deterministic_torch(seed):
        config = Qwen2Config(
            vocab_size=recipe.padded_vocab_size,
            hidden_size=recipe.hidden_size,
            intermediate_size=recipe.intermediate_size,
            num_hidden_layers=recipe.num_layers,
            num_attention_heads=recipe.num_heads,
            num_key_value_heads=recipe.num_kv_heads,
            max_position_embeddings=recipe.max_position_embeddings,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
            use_sliding_window=False,
            architectures=["Qwen2ForCausalLM"],
        )
        model = Qwen2ForCausalLM(config)
        warm_start(model, tokenizer, task, recipe, seed, progress)
        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id)
        save_model_dir(out_dir, model, tokenizer)
        train_seconds = time.perf_counter() - start
        accuracy = sampled_accuracy(out_dir, task, recipe)
    write_build_info(out_dir, name="tiny-chat", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=model, accuracy=accuracy, train_seconds=train_seconds, tokenizer_size=len(tokenizer),
                     protocol=f"first {recipe.eval_prompts} val prompts x {recipe.eval_samples_per_prompt} samples, "
                     f"temperature 1.0, at most {recipe.eval_max_tokens} tokens, seed {recipe.eval_seed}")
    return out_dir


def chat_prompt_ids(tokenizer: Any, expressions: list[str]) -> list[list[int]]:
    """Token ids of each expression's question in ChatML, ending with the assistant header."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": question(e)}], tokenize=False,
                                           add_generation_prompt=True) for e in expressions]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def warm_start(model: Any, tokenizer: Any, task: ChainTask, recipe: Recipe, seed: int, progress: bool) -> None:
    """Teacher forcing on the ChatML prompt -> worked solution + <|im_end|>, loss on the response."""
    problems = task.problems("train")
    prompts = chat_prompt_ids(tokenizer, [p.prompt for p in problems])
    answers = tokenizer([solution(p.prompt) for p in problems], add_special_tokens=False)["input_ids"]
    supervised_fit(model, prompts, [a + [tokenizer.eos_token_id] for a in answers], recipe,
                   pad_id=tokenizer.pad_token_id, seed=seed, label="builtin:tiny-chat",
                   progress=progress, trim_padding=True)


def sampled_accuracy(model_dir: Path, task: ChainTask, recipe: Recipe = RECIPE) -> float:
    """Fraction of temperature-1 samples on the first val prompts that verify as correct."""
    return sampled_accuracy_of(
        model_dir, task.problems("val")[: recipe.eval_prompts], chat_prompt_ids, verify_chain,
        samples_per_prompt=recipe.eval_samples_per_prompt, max_tokens=recipe.eval_max_tokens, seed=recipe.eval_seed)
