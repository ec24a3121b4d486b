"""``builtin:tiny-gym``: a ~0.14M-parameter character-level Llama warm-started on two
reasoning-gym tasks: ``spell_backward`` on words of 3 to 5 letters (``Spell this word backward
(example: sun -> nus): bird``, the source ``graphs/gym.yaml`` trains on) and ``letter_counting``
on spans of 3 to 5 words (``How many times does the letter "b" appear in the text: "phrase
Project Gutenberg associated"?``), which ``graphs/ablations/gym-mixture.yaml`` mixes in 3:1.
Reversing a word is learned as a rule: greedy accuracy on held-out words (~0.26) is about that on
train words and well above sampled accuracy at temperature 1 (~0.07), the regime in which RL at
temperature 1 gains. Counting is not learned: greedy answers the commonest count (1, ~0.57 of
the items, held out or not), samples at temperature 1 are right ~0.38 of the time, so RL can gain
there by moving samples onto it. docs/results.md has what RL made of both (and of
``basic_arithmetic``, the task before, whose sums the warm start memorized rather than learned,
and of the second tasks tried before letter_counting).

It is prompted as the graph prompts it: reasoning-gym's ``direct`` system prompt (answer between
``<answer>`` tags, nothing else), a newline, the question (the tokenizer has no chat template,
so ``data.prompts`` joins the messages' contents by lines), and answers
``<answer>ANSWER</answer>`` then EOS. The warm start sees the train splits the graphs train on
(seed 0: :data:`TRAIN_SIZE` spell_backward items, :data:`SECOND_TRAIN_SIZE` letter_counting ones,
:data:`TASKS`); each step's batch is one task's, the task drawn in proportion to its rows, so
that the prompts of a batch share their task's opening (:func:`shared_prefix_fit`). The build's
accuracy is measured per task on the validation split's first ``eval_items`` items (seed
``VAL_SEED_OFFSET``) less those a train item equals, as the graphs' validation reads them. A
spell_backward question is a fixed sentence and the word, so "a train item equals it" is "its
word is a train word": every validation word is unseen (letter_counting's validation keeps 497
of its first 500 items). As with tiny-adder, a fixed step count, fixed seeds, one thread and
deterministic kernels make a build reproducible on one machine type. reasoning-gym (the ``gym``
extra) is needed to build it.
"""

from __future__ import annotations

import json
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_flow.data import reasoning_gym as gym
from dapo_flow.recipes.warm_start import (
    char_llama, deterministic_torch, sampled_accuracy_of, save_model_dir, set_generation_config, write_build_info)

RECIPE_VERSION = 3  # bump whenever the recipe (and so the bytes) changes: it names the cache dir
TASK = "spell_backward"
CONFIG = {"min_word_len": 3, "max_word_len": 5}  # ~16,800 words of the library's word list
SYSTEM_PROMPT = "direct"
TRAIN_SIZE = 8000  # graphs/gym.yaml's data.train.size: 6,357 distinct words
# the second task the warm start covers (graphs/ablations/gym-mixture.yaml mixes it in 3:1):
# `How many times does the letter "b" appear in the text: "phrase Project Gutenberg associated"?`:
# a span of 3 to 5 words of a book, a letter it holds
SECOND_TASK = "letter_counting"
SECOND_CONFIG = {"min_words": 3, "max_words": 5}
SECOND_TRAIN_SIZE = 2667  # gym-mixture.yaml's size for it: a third of spell_backward's rows
TASKS = ((TASK, CONFIG, TRAIN_SIZE), (SECOND_TASK, SECOND_CONFIG, SECOND_TRAIN_SIZE))
# printable ASCII but the rarer whitespace: every character reasoning-gym's prompts use here
CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


@dataclass(frozen=True)
class Recipe:
    hidden_size: int = 64
    num_heads: int = 2  # head_dim 32 (vLLM's CPU attention takes it)
    num_layers: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 320  # a <= 250-character prompt (letter_counting's) and a <= 23-token reply
    steps: int = 800  # ~600 on spell_backward's batches, ~200 on letter_counting's (in proportion to their rows)
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    # no label smoothing, unlike tiny-adder: it would put mass on every character of the ~21-character
    # reply, and samples at temperature 1 would almost never write `<answer>...</answer>` whole
    # (on basic_arithmetic 0.2 gave 0.2% sampled accuracy at 42% greedy); what stays uncertain is the word
    label_smoothing: float = 0.0
    eval_items: int = 500  # each task's first val items (310 and 497 once train repeats are dropped): the graphs' val
    eval_samples_per_prompt: int = 4
    eval_seed: int = 1234


RECIPE = Recipe()
VOCAB_SIZE = 4 + len(CHARS)  # <pad> <s> </s> <unk>, then one id per character


def shape_config(recipe: Recipe = RECIPE) -> dict[str, Any]:
    """The config.json keys that size the model, known before it is built."""
    return {"model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": recipe.hidden_size,
            "intermediate_size": recipe.intermediate_size, "num_hidden_layers": recipe.num_layers,
            "num_attention_heads": recipe.num_heads, "num_key_value_heads": recipe.num_heads,
            "max_position_embeddings": recipe.max_position_embeddings, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Item:
    prompt: str  # the text the model sees
    answer: str  # the row's ground truth (JSON: what builtin:reasoning-gym scores with)
    reply: str  # the warm start's target


def items(split: str, size: int, task: str = TASK, config: dict[str, Any] = CONFIG,
          train_size: int = TRAIN_SIZE) -> list[Item]:
    """The split's items of ``task`` as the graph's source serves them (train at seed 0, val at
    the default val seed without the items train repeats: the first ``train_size`` at seed 0)."""
    avoid = gym.questions(task, config, seed=0, size=train_size) if split == "val" else set()
    rows, _ = gym.records(task, config, seed=gym.default_seed(split, 0), size=size,
                          options={"system_prompt": SYSTEM_PROMPT}, avoid=avoid)
    return [Item("\n".join(m["content"] for m in f["prompt"]), f["ground_truth"],
                 f"<answer>{json.loads(f['ground_truth'])['entry']['answer']}</answer>") for _, f in rows]


def build_tiny_gym(out_dir: Path, *, seed: int = 0, progress: bool = True, recipe: Recipe = RECIPE) -> Path:
    """Build, warm-start, save and evaluate the model into ``out_dir``; returns ``out_dir``."""
    from dapo_flow.models.tokenizer import build_char_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer(CHARS, model_max_length=recipe.max_position_embeddings)
    train, groups = [], []
    for k, (task, config, size) in enumerate(TASKS):
        train += items("train", size, task, config, size)
        groups += [k] * (len(train) - len(groups))
    start = time.perf_counter()
    with deterministic_torch(seed):
        model = char_llama(tokenizer, recipe)
        prompts = tokenizer([i.prompt for i in train], add_special_tokens=False)["input_ids"]
        replies = tokenizer([i.reply for i in train], add_special_tokens=False)["input_ids"]
        shared_prefix_fit(model, prompts, [r + [tokenizer.eos_token_id] for r in replies], recipe,
                          pad_id=tokenizer.pad_token_id, seed=seed, progress=progress, groups=groups)
        set_generation_config(model, tokenizer)
        save_model_dir(out_dir, model, tokenizer)
        train_seconds = time.perf_counter() - start
        accuracy = {task: sampled_accuracy(out_dir, recipe, task) for task, _, _ in TASKS}
    write_build_info(out_dir, name="tiny-gym", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=model, accuracy=accuracy, train_seconds=train_seconds,
                     task={"source": f"{gym.PREFIX}{TASK}", "config": CONFIG, "system_prompt": SYSTEM_PROMPT},
                     tasks=[{"source": f"{gym.PREFIX}{t}", "config": c, "train_size": n} for t, c, n in TASKS],
                     protocol=f"per task: first {recipe.eval_items} val items (less train repeats) x "
                     f"{recipe.eval_samples_per_prompt} samples, temperature 1.0, seed {recipe.eval_seed}")
    return out_dir


def shared_prefix_fit(model: Any, prompts: list[list[int]], responses: list[list[int]], recipe: Recipe, *,
                      pad_id: int, seed: int, progress: bool, groups: list[int] | None = None) -> None:
    """``warm_start.supervised_fit``'s teacher forcing (label-smoothed cross-entropy on the
    responses, AdamW, warmup then cosine) computed once per step over the prompts' common prefix:
    every prompt of a task opens with the same characters (system prompt, the question's
    wording), whose keys and values do not depend on what follows (causal attention), so the
    prefix runs once and its KV cache is repeated over the batch; the loss and gradients are a
    full forward pass's (to float rounding), at about a sixth of the cost. ``groups``: a task id
    per row; each step's rows then all come from one task (the prefix is that task's), drawn in
    proportion to its rows, and the loss is that batch's token mean."""
    import torch
    import torch.nn.functional as F

    from dapo_flow.recipes.warm_start import lr_factor, supervised_labels

    keys = sorted(set(groups)) if groups else [None]
    parts = []  # per group: its common prefix, then the rows' suffix ids, mask and targets
    for key in keys:
        rows = [i for i in range(len(prompts)) if groups is None or groups[i] == key]
        ps = [prompts[i] for i in rows]
        n = 0  # the common prefix, short of every prompt's last token (it predicts the response)
        while all(len(p) > n + 1 and p[n] == ps[0][n] for p in ps):
            n += 1
        ids, mask, labels = supervised_labels([p[n:] for p in ps], [responses[i] for i in rows], pad_id=pad_id)
        parts.append((n, torch.tensor([ps[0][:n]]), ids, mask, labels[:, 1:]))
    shares = torch.tensor([float(len(part[2])) for part in parts])
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
    model.train()
    for step in range(recipe.steps):
        k = int(torch.multinomial(shares, 1, generator=gen)) if groups else 0
        n, prefix, ids, mask, targets = parts[k]
        idx = torch.randint(len(ids), (recipe.batch_size,), generator=gen)
        width = int(mask[idx].sum(-1).max())
        cache = model.model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(recipe.batch_size)
        full_mask = torch.cat([torch.ones(recipe.batch_size, n, dtype=mask.dtype), mask[idx, :width]], 1)
        hidden = model.model(input_ids=ids[idx, :width], attention_mask=full_mask, past_key_values=cache,
                             use_cache=True).last_hidden_state
        batch_targets = targets[idx, : width - 1]
        scored = batch_targets != -100
        loss = F.cross_entropy(model.lm_head(hidden[:, :-1][scored]), batch_targets[scored],
                               label_smoothing=recipe.label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if progress and (step % 100 == 0 or step + 1 == recipe.steps):
            print(f"building builtin:tiny-gym: step {step + 1}/{recipe.steps}, loss {loss.item():.3f}", flush=True)
    model.eval()


def task_items(split: str, size: int, task: str = TASK) -> list[Item]:
    """:func:`items` of one of :data:`TASKS`, by name."""
    _, config, train_size = next(t for t in TASKS if t[0] == task)
    return items(split, size, task, config, train_size)


def sampled_accuracy(model_dir: Path, recipe: Recipe = RECIPE, task: str = TASK) -> float:
    """Fraction of temperature-1 samples the library scores 1 on the task's first val items."""
    return sampled_accuracy_of(
        model_dir, task_items("val", recipe.eval_items, task),
        lambda tok, prompts: tok(prompts, add_special_tokens=False)["input_ids"],
        lambda text, truth: float(gym.library_score(text, truth) >= 1.0),
        samples_per_prompt=recipe.eval_samples_per_prompt, max_tokens=24, seed=recipe.eval_seed)
