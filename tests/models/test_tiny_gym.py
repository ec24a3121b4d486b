"""builtin:tiny-gym's recipe: it is warm-started on the prompts the graph's source gives, and its
shared-prefix fit trains exactly what the plain teacher-forced fit trains."""

from __future__ import annotations

import dataclasses

import torch

from dapo_flow.models.tokenizer import build_char_tokenizer
from dapo_flow.recipes import tiny_gym
from dapo_flow.recipes.warm_start import char_llama, deterministic_torch, supervised_fit


def test_the_warm_start_sees_the_prompts_the_source_serves():
    from dapo_flow.data.prompts import load_prompts

    tok = build_char_tokenizer(tiny_gym.CHARS)
    table, _ = load_prompts(f"reasoning_gym:{tiny_gym.TASK}", tokenizer=tok, seed=0, size=3,
                            config=dict(tiny_gym.CONFIG), options={"system_prompt": tiny_gym.SYSTEM_PROMPT})
    items = tiny_gym.items("train", 3)
    assert table.column("prompt_ids").to_pylist() == tok([i.prompt for i in items], add_special_tokens=False)["input_ids"]
    assert table.column("ground_truth").to_pylist() == [i.answer for i in items]
    assert all(tok.unk_token_id not in ids for ids in table.column("prompt_ids").to_pylist())


def test_the_shared_prefix_fit_trains_what_the_plain_fit_trains():
    recipe = dataclasses.replace(tiny_gym.RECIPE, steps=3, batch_size=4, warmup_steps=1)
    tok = build_char_tokenizer(tiny_gym.CHARS)
    items = tiny_gym.items("train", 12)
    prompts = tok([i.prompt for i in items], add_special_tokens=False)["input_ids"]
    replies = [r + [tok.eos_token_id] for r in tok([i.reply for i in items], add_special_tokens=False)["input_ids"]]
    models = []
    for fit in ("plain", "shared"):
        with deterministic_torch(0):
            model = char_llama(tok, recipe)
            if fit == "plain":
                supervised_fit(model, prompts, replies, recipe, pad_id=tok.pad_token_id, seed=0, label="t",
                               progress=False, trim_padding=True)
            else:
                tiny_gym.shared_prefix_fit(model, prompts, replies, recipe, pad_id=tok.pad_token_id, seed=0,
                                           progress=False)
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not torch.equal(next(models[0].parameters()), next(char_llama(tok, recipe).parameters()))


def test_a_grouped_fit_trains_each_task_on_its_own_batches_as_a_full_pass_would():
    """Two tasks: each step's rows come from one task (its own common prefix), drawn in proportion
    to its rows; the result is what full forward passes over the same batches train."""
    import torch.nn.functional as F

    from dapo_flow.recipes.warm_start import lr_factor, supervised_labels

    recipe = dataclasses.replace(tiny_gym.RECIPE, steps=4, batch_size=4, warmup_steps=1)
    tok = build_char_tokenizer(tiny_gym.CHARS)
    items = tiny_gym.items("train", 8) + tiny_gym.task_items("train", 4, tiny_gym.SECOND_TASK)
    groups = [0] * 8 + [1] * 4
    prompts = tok([i.prompt for i in items], add_special_tokens=False)["input_ids"]
    replies = [r + [tok.eos_token_id] for r in tok([i.reply for i in items], add_special_tokens=False)["input_ids"]]
    with deterministic_torch(0):
        shared = char_llama(tok, recipe)
        tiny_gym.shared_prefix_fit(shared, prompts, replies, recipe, pad_id=tok.pad_token_id, seed=0,
                                   progress=False, groups=groups)
    with deterministic_torch(0):
        plain = char_llama(tok, recipe)
        parts = [supervised_labels([prompts[i] for i in rows], [replies[i] for i in rows], pad_id=tok.pad_token_id)
                 for rows in (range(8), range(8, 12))]
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.AdamW(plain.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
        plain.train()
        drawn = set()
        for _ in range(recipe.steps):
            k = int(torch.multinomial(torch.tensor([8.0, 4.0]), 1, generator=gen))
            drawn.add(k)
            ids, mask, labels = parts[k]
            idx = torch.randint(len(ids), (recipe.batch_size,), generator=gen)
            logits = plain(input_ids=ids[idx], attention_mask=mask[idx]).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[idx, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    assert drawn == {0, 1}
    for a, b in zip(shared.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
