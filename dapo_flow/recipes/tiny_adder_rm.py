"""``builtin:tiny-adder-rm``: a reward model for ``builtin:tiny-adder`` on ``a+b=``, trained on the
policy's own right and wrong samples (verl's RM worker scores with such a sequence classifier).

tiny-adder's backbone under a sequence-classification head of one logit, trained with binary
cross-entropy to say whether a response is the right sum. Each batch pairs a right and a wrong
response to the same prompts, so the verdict has to come from the answer: the right ones are the
gold answers and tiny-adder's right samples, the wrong ones its wrong temperature-1 samples on the
train split (the mistakes a policy really makes, unfinished ones included), near misses of the
sum, and the right answers of other prompts (so that no answer is liked for itself: a policy
trained against an RM built without them answered 108 to every prompt).

How good it is, in the build info: agreement with the rule verifier on tiny-adder's samples for
held-out val prompts, 0.87 on an AMD EPYC build (0.90 on the right ones, 0.86 on the wrong) and
0.76 on an Intel Xeon build; within a prompt's samples it ranks a right one above a wrong one
93% / 86% of the time. That is not enough to train against alone: GRPO on its score lowers the
true accuracy (near misses such as 47 for 12+34 score almost as high as the sum, and the policy
drifts to them), which is why graphs/rm.yaml adds it to the rule reward. Verifying a sum at the
last token is harder for this 2-layer model than writing it digit by digit; builtin:tiny-adder-judge,
a generative verifier, checks each digit where it would write it, and RL against it alone works.
Fixed seeds, one thread and deterministic kernels make the bytes the same on every build of a CPU
type; it takes about 3.5 minutes on 2 cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dapo_flow.data.tasks import AdditionTask, verify_addition
from dapo_flow.recipes import tiny_adder

RECIPE_VERSION = 100 * tiny_adder.RECIPE_VERSION + 2


@dataclass(frozen=True)
class Recipe:
    train_prompts: int = 4000  # sampled from the train split
    samples_per_prompt: int = 4
    steps: int = 6000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    val_prompts: int = 500
    eval_seed: int = 4321


RECIPE = Recipe()


def shape_config() -> dict[str, Any]:
    """The policy's shape; the reward head (hidden -> 1) replaces its output head."""
    return {**tiny_adder.shape_config(), "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}


def build_tiny_adder_rm(out_dir: Path, *, seed: int = 0, progress: bool = True, recipe: Recipe = RECIPE) -> Path:
    """Sample, label, train and save the reward model into ``out_dir``; returns ``out_dir``."""
    import numpy as np
    import torch

    from dapo_flow.models import resolve_model
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.recipes.warm_start import deterministic_torch, lr_factor, save_model_dir, write_build_info

    out_dir = Path(out_dir)
    task = AdditionTask()
    policy_dir = resolve_model("builtin:tiny-adder", progress=progress)
    start = time.perf_counter()
    with deterministic_torch(seed):
        train = task.problems("train")[: recipe.train_prompts]
        right, wrong = _answers_per_prompt(policy_dir, train, recipe, seed)
        rm = HFPolicy(policy_dir, head="reward", trainable=True)
        opt = torch.optim.AdamW(rm.model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe))
        rng = np.random.default_rng(seed)
        prompt_ids = rm.tokenizer([p.prompt for p in train], add_special_tokens=True)["input_ids"]
        target = torch.tensor([1.0, 0.0] * (recipe.batch_size // 2))
        for _ in range(recipe.steps):
            # a right and a wrong answer to each prompt of the batch: the verdict has to come
            # from the answer, not from what the prompt looks like
            picked = rng.integers(len(train), size=recipe.batch_size // 2)
            prompts, responses = [], []
            for i in picked:
                prompts += [prompt_ids[i], prompt_ids[i]]
                responses += [right[i][rng.integers(len(right[i]))], wrong[i][rng.integers(len(wrong[i]))]]
            scores = rm.response_scores(prompts, responses, grad=True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        save_model_dir(out_dir, rm.model, rm.tokenizer)
        train_seconds = time.perf_counter() - start
        agreement = _agreement(out_dir, policy_dir, task.problems("val")[: recipe.val_prompts], recipe)
    write_build_info(out_dir, name="tiny-adder-rm", recipe_version=RECIPE_VERSION, recipe=recipe, seed=seed,
                     model=rm.model, accuracy=agreement["agreement"], train_seconds=train_seconds,
                     protocol=f"agreement with the rule verifier on {recipe.val_prompts} val prompts x "
                     f"{recipe.samples_per_prompt} tiny-adder samples (temperature 1, seed {recipe.eval_seed})",
                     **agreement)
    return out_dir


def _answers_per_prompt(policy_dir: Path, problems: list, recipe: Recipe, seed: int
                        ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Per prompt, its right responses (the gold answer, and tiny-adder's right samples) and its
    wrong ones: tiny-adder's wrong samples (unfinished ones included), three near misses of the
    sum (off by 1, 2, 9, 10 or 11, or its digits reversed) and other prompts' answers, each
    response ending in EOS unless it was cut off."""
    import numpy as np
    from transformers import AutoTokenizer

    _, responses, labels, index = _labelled_samples(policy_dir, problems, recipe.samples_per_prompt, seed)
    right = [[] for _ in problems]
    wrong = [[] for _ in problems]
    for response, label, i in zip(responses, labels, index):
        (right if label else wrong)[i].append(response)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    rng = np.random.default_rng(seed)
    for i, problem in enumerate(problems):
        answer = int(problem.answer)
        right[i].append(tok.encode(problem.answer, add_special_tokens=False) + [tok.eos_token_id])
        misses = {answer + d for d in (-11, -10, -9, -2, -1, 1, 2, 9, 10, 11)} | {int(str(answer)[::-1])}
        misses = sorted(m for m in misses if m >= 0 and m != answer)
        # the right answers of other prompts: a reward model must not like an answer for itself
        others = [int(problems[j].answer) for j in rng.integers(len(problems), size=4)]
        picked = [*rng.choice(misses, size=min(3, len(misses)), replace=False), *(o for o in others if o != answer)]
        for m in picked:
            wrong[i].append(tok.encode(str(m), add_special_tokens=False) + [tok.eos_token_id])
    return right, wrong


def _labelled_samples(policy_dir: Path, problems: list, n: int, seed: int
                      ) -> tuple[list[list[int]], list[list[int]], list[float], list[int]]:
    """tiny-adder's temperature-1 samples for ``problems``: prompt ids, response ids, label 1.0
    where the rule verifier says the sum is right, and each sample's problem index."""
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    policy = HFPolicy(policy_dir)
    tok = policy.tokenizer
    prompt_ids = tok([p.prompt for p in problems], add_special_tokens=True)["input_ids"]
    out = policy.generate(prompt_ids, SamplingConfig(n=n, temperature=1.0, max_tokens=8, seed=seed))
    texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    labels = [float(verify_addition(t, problems[i].answer) > 0) for t, i in zip(texts, out.prompt_index)]
    return [prompt_ids[i] for i in out.prompt_index], list(out.response_ids), labels, [int(i) for i in out.prompt_index]


def _agreement(rm_dir: Path, policy_dir: Path, problems: list, recipe: Recipe) -> dict[str, float]:
    """How often the reward model's verdict (score > 0) is the rule verifier's on tiny-adder's
    samples for ``problems`` (:func:`agreement_with_rule`)."""
    from dapo_flow.models.hf import HFPolicy

    rm = HFPolicy(rm_dir, head="reward")
    return agreement_with_rule(lambda prompts, responses: rm.response_scores(prompts, responses) > 0,
                               policy_dir, problems, recipe.samples_per_prompt, recipe.eval_seed)


def agreement_with_rule(verdicts: Callable[[list[list[int]], list[list[int]]], Any], policy_dir: Path,
                        problems: list, samples_per_prompt: int, seed: int) -> dict[str, float]:
    """How often ``verdicts(prompt_ids, response_ids)`` (a bool tensor: right or not) is the rule
    verifier's on tiny-adder's temperature-1 samples for ``problems``: overall, on the right
    samples and on the wrong ones."""
    import torch

    prompts, responses, labels, _ = _labelled_samples(policy_dir, problems, samples_per_prompt, seed)
    verdict = verdicts(prompts, responses)
    truth = torch.tensor(labels) > 0
    agree = (verdict == truth).float()
    return {"agreement": round(float(agree.mean()), 4), "agreement_on_right": round(float(agree[truth].mean()), 4),
            "agreement_on_wrong": round(float(agree[~truth].mean()), 4)}
