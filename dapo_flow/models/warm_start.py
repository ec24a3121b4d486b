"""The supervised warm start of the built-in models, and what every build writes.

Shared by ``tiny_adder`` and ``tiny_chat``: one thread, deterministic kernels and fixed seeds
(``deterministic_torch``) make a build's bytes reproducible; ``supervised_fit`` is the teacher-
forced fit on prompt -> response; ``write_build_info`` records how the model was made.
Heavy imports live inside functions.
"""

from __future__ import annotations

import json
import math
import platform
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

BUILD_INFO = "dapo_flow_build.json"


def save_model_dir(out_dir: Path, model: Any, tokenizer: Any) -> None:
    """A plain Hugging Face directory: config, weights, generation config and tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def write_build_info(out_dir: Path, *, name: str, recipe_version: int, recipe: Any, seed: int, model: Any,
                     accuracy: float, protocol: str, train_seconds: float, **extra: Any) -> None:
    """``dapo_flow_build.json``: the recipe, the seed, the size and the sampled accuracy of a build."""
    import torch

    info = {
        "name": name,
        "recipe_version": recipe_version,
        "recipe": asdict(recipe),
        "seed": seed,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        **extra,
        "val_sampled_accuracy": accuracy,
        "val_accuracy_protocol": protocol,
        "train_seconds": round(train_seconds, 2),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def sampled_accuracy_of(model_dir: Path, problems: list, prompt_ids: Callable[[Any, list[str]], list[list[int]]],
                     verify: Callable[[str, str], float], *, samples_per_prompt: int, max_tokens: int,
                     seed: int) -> float:
    """Fraction of temperature-1 samples of the model in ``model_dir`` on ``problems`` (each with
    ``.prompt`` and ``.answer``) that ``verify(text, answer)`` scores above 0. ``prompt_ids``:
    (tokenizer, prompts) -> token ids, as the model is prompted."""
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    policy = HFPolicy(model_dir)
    cfg = SamplingConfig(n=samples_per_prompt, temperature=1.0, max_tokens=max_tokens, seed=seed)
    out = policy.generate(prompt_ids(policy.tokenizer, [p.prompt for p in problems]), cfg)
    texts = policy.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    right = [verify(t, problems[i].answer) > 0 for t, i in zip(texts, out.prompt_index)]
    return round(sum(right) / len(right), 4)


def supervised_fit(model: Any, prompts: list[list[int]], responses: list[list[int]], recipe: Any, *,
                   pad_id: int, seed: int, label: str, progress: bool, trim_padding: bool = False) -> None:
    """Teacher forcing on prompt + response, loss (label-smoothed cross-entropy) on the response
    tokens only: ``recipe.steps`` AdamW steps of ``recipe.batch_size`` random rows, linear warmup
    then cosine decay. ``trim_padding``: cut each batch to its longest row and apply the LM head
    only at response positions (the same loss, faster; off for tiny-adder, whose cached bytes
    were built the plain way; the model must expose ``.model`` and ``.lm_head``, as HF's do)."""
    import torch
    import torch.nn.functional as F
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dapo_flow.models.hf import right_pad

    seqs = [p + a for p, a in zip(prompts, responses)]
    ids, mask = right_pad(seqs, pad_id)
    labels = ids.masked_fill(mask == 0, -100)
    for i, p in enumerate(prompts):
        labels[i, : len(p)] = -100  # no loss on the prompt
    targets = labels[:, 1:]

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
    model.train()
    with Progress(
        TextColumn(f"building {label}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), disable=not progress, transient=True,
    ) as bar:
        job = bar.add_task("train", total=recipe.steps, loss=float("nan"))
        for step in range(recipe.steps):
            idx = torch.randint(len(seqs), (recipe.batch_size,), generator=gen)
            if trim_padding:  # the batch's longest row; the LM head only where there is a loss
                width = int(mask[idx].sum(-1).max())
                hidden = model.model(input_ids=ids[idx, :width], attention_mask=mask[idx, :width]).last_hidden_state
                batch_targets = targets[idx, : width - 1]
                scored = batch_targets != -100
                loss = F.cross_entropy(model.lm_head(hidden[:, :-1][scored]), batch_targets[scored],
                                       label_smoothing=recipe.label_smoothing)
            else:
                logits = model(input_ids=ids[idx], attention_mask=mask[idx]).logits[:, :-1]
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1),
                    label_smoothing=recipe.label_smoothing,
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 50 == 0 or step + 1 == recipe.steps:
                bar.update(job, completed=step + 1, loss=loss.item())
    model.eval()


def lr_factor(step: int, recipe: Any) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@contextmanager
def deterministic_torch(seed: int) -> Iterator[None]:
    """One thread, deterministic kernels, a fixed seed, no HF progress bars; restores the caller's settings."""
    import torch

    from dapo_flow.models.hf import hf_progress_bars_off
    from dapo_flow.threads import set_torch_threads  # torch's own setter, even after vLLM's no-op

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    set_torch_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        with hf_progress_bars_off():  # our rich bar is the only one shown
            yield
    finally:
        set_torch_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng)
