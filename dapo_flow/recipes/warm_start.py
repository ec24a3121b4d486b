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


def char_llama(tokenizer: Any, recipe: Any) -> Any:
    """A fresh LlamaForCausalLM for a character-tokenizer built-in (tiny-adder, tiny-agent):
    ``recipe``'s hidden_size, intermediate_size, num_layers, num_heads (as many KV heads),
    max_position_embeddings; untied embeddings. Its initialisation draws from torch's global
    generator: build it inside :func:`deterministic_torch` for reproducible bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ))


def set_generation_config(model: Any, tokenizer: Any) -> None:
    """The tokenizer's BOS / EOS / PAD ids as the model's generation config (what HF and vLLM read)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)


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
                   pad_id: int, seed: int, label: str, progress: bool, trim_padding: bool = False,
                   loss_masks: list[list[int]] | None = None, groups: list[int] | None = None) -> None:
    """Teacher forcing on prompt + response, loss (label-smoothed cross-entropy) on the response
    tokens only (:func:`supervised_labels`; ``loss_masks``: also not on a response's 0 tokens,
    e.g. a tool's output): ``recipe.steps`` AdamW steps of ``recipe.batch_size`` random rows,
    linear warmup then cosine decay. ``trim_padding``: cut each batch to its longest row and apply
    the LM head only at response positions (the same loss, faster; off for tiny-adder, whose
    cached bytes were built the plain way; the model must expose ``.model`` and ``.lm_head``, as
    HF's do). ``groups``: a group id per row; each step's rows all come from one group, each group
    as often (rows of one length together: with ``trim_padding``, short rows are not padded to
    the long ones' width), its loss weighed so that every token weighs what it would in mixed
    batches (:func:`group_weights`)."""
    import torch
    import torch.nn.functional as F
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    ids, mask, labels = supervised_labels(prompts, responses, pad_id=pad_id, loss_masks=loss_masks)
    targets = labels[:, 1:]

    gen = torch.Generator().manual_seed(seed)
    members = [torch.tensor([i for i, g in enumerate(groups) if g == k]) for k in sorted(set(groups))] if groups else []
    weights = group_weights([len(m) for m in members], int((targets != -100).sum()), recipe.batch_size)
    reduction = "sum" if groups else "mean"
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
    model.train()
    with Progress(
        TextColumn(f"building {label}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), disable=not progress, transient=True,
    ) as bar:
        job = bar.add_task("train", total=recipe.steps, loss=float("nan"))
        for step in range(recipe.steps):
            if groups:
                k = int(torch.randint(len(members), (1,), generator=gen))
                idx = members[k][torch.randint(len(members[k]), (recipe.batch_size,), generator=gen)]
            else:
                idx = torch.randint(len(ids), (recipe.batch_size,), generator=gen)
            if trim_padding:  # the batch's longest row; the LM head only where there is a loss
                width = int(mask[idx].sum(-1).max())
                hidden = model.model(input_ids=ids[idx, :width], attention_mask=mask[idx, :width]).last_hidden_state
                batch_targets = targets[idx, : width - 1]
                scored = batch_targets != -100
                loss = F.cross_entropy(model.lm_head(hidden[:, :-1][scored]), batch_targets[scored],
                                       label_smoothing=recipe.label_smoothing, reduction=reduction)
            else:
                logits = model(input_ids=ids[idx], attention_mask=mask[idx]).logits[:, :-1]
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1),
                    label_smoothing=recipe.label_smoothing, reduction=reduction,
                )
            if groups:
                loss = loss * weights[k]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 50 == 0 or step + 1 == recipe.steps:
                bar.update(job, completed=step + 1, loss=loss.item())
    model.eval()


def group_weights(sizes: list[int], scored_tokens: int, batch_size: int) -> list[float]:
    """The loss weight of a step on each group (its rows' summed token losses times this): a
    group drawn as often as any other (1/G of the steps) but holding its share of the rows
    (size / total) is weighed share * G, and the sum is divided by an average mixed batch's
    scored tokens; the expected step is then the mixed batches' token mean (in a group's own
    token mean, a short row's tokens would weigh more: the tool-call choice would skew)."""
    total, per_batch = sum(sizes), scored_tokens * batch_size / max(sum(sizes), 1)
    return [size / total * len(sizes) / per_batch for size in sizes]


def supervised_labels(prompts: list[list[int]], responses: list[list[int]], *, pad_id: int,
                      loss_masks: list[list[int]] | None = None) -> tuple[Any, Any, Any]:
    """Right-padded prompt + response rows and their labels: the token where it is trained on,
    -100 (ignored) on the prompt, on padding and where the response's loss mask is 0.
    Shape: ids, attention mask, labels (rows, longest row) long."""
    import torch

    from dapo_flow.models.hf import right_pad

    ids, mask = right_pad([p + r for p, r in zip(prompts, responses)], pad_id)
    labels = ids.masked_fill(mask == 0, -100)
    for i, p in enumerate(prompts):
        labels[i, : len(p)] = -100  # no loss on the prompt
    if loss_masks is not None and len(loss_masks) != len(responses):
        raise ValueError(f"{len(loss_masks)} loss masks for {len(responses)} responses")
    for i, (p, r, m) in enumerate(zip(prompts, responses, loss_masks or ())):
        if len(m) != len(r):
            raise ValueError(f"row {i}: a loss mask of {len(m)} tokens for a response of {len(r)}")
        labels[i, len(p) : len(p) + len(r)][torch.as_tensor(m) == 0] = -100  # a view: set in place
    return ids, mask, labels


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
