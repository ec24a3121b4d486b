"""`train.mixed_precision: bf16`: the trained copy holds float32 master weights whatever the
model's dtype (which every copy not trained keeps), and weight syncs cast into those copies.
Without FSDP2 (strategy none / ddp) the policy's forwards run under torch.autocast(bf16) while
its weights, gradients and AdamW state stay float32; old logprobs recomputed in the same
precision as the update's, so importance ratios start at 1; and a bf16 run learns. FSDP2: a
one-process gloo group (a subprocess) checks its float32 shards under a bfloat16 dtype."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_flow.data.tasks import AdditionTask
from dapo_flow.errors import ModelError
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.operators.logprob import Logprob
from dapo_flow.operators.logprob import Params as LogprobParams
from dapo_flow.operators.update import Params, Update
from figures import assert_figures, start_end

MIXED = ModelSpec(path="builtin:tiny-adder", train={"mixed_precision": "bf16"})


def _problems(n: int, split: str = "train"):
    return AdditionTask().problems(split)[:n]


def _batch(policy: HFPolicy, problems, *, wrong: bool = True) -> pa.Table:
    """Each problem's correct answer with advantage +1 and (``wrong``) the answer + 1 with -1."""
    tok = policy.tokenizer
    prompts, responses, adv = [], [], []
    for p in problems:
        answers = [(p.answer, 1.0)] + ([(str(int(p.answer) + 1), -1.0)] if wrong else [])
        for text, a in answers:
            prompts.append(tok.encode(p.prompt))
            responses.append(tok.encode(text, add_special_tokens=False) + [policy.eos_id])
            adv.append(a)
    return pa.table({C.PROMPT_IDS: pa.array(prompts, C.TOKENS), C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
                     C.ADVANTAGE: pa.array(np.asarray(adv, dtype=np.float32))})


def _with_old_logp(policy: HFPolicy, batch: pa.Table) -> pa.Table:
    """The logprob node (source: recompute, as verl): a no-grad forward of the trainer."""
    op = Logprob(LogprobParams(with_entropy=False), OpContext("old_logp", model=SimpleNamespace(policy=policy)))
    return op(batch)


def _update(policy: HFPolicy, spec: ModelSpec = MIXED, **params) -> Update:
    return Update(Params(**{"lr": 1e-3, "warmup_steps": 0, "mini_batches": 1, **params}),
                  OpContext("train", model=SimpleNamespace(policy=policy, spec=spec)))


@pytest.fixture()
def mixed(tiny_adder_path) -> HFPolicy:
    return HFPolicy(tiny_adder_path, trainable=True, mixed_precision="bf16")


def test_an_update_computes_in_bf16_and_keeps_float32_weights_gradients_and_adamw_state(mixed):
    seen: list[tuple[torch.dtype, bool]] = []  # (a Linear's output dtype, under autograd)
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append((out.dtype, torch.is_grad_enabled())))
             for m in mixed.model.modules() if isinstance(m, torch.nn.Linear)]
    before = {k: v.clone() for k, v in mixed.model.state_dict().items()}
    batch = _with_old_logp(mixed, _batch(mixed, _problems(8)))
    op = _update(mixed, mini_batches=2)
    row = op(batch).to_pylist()[0]
    for h in hooks:
        h.remove()

    assert row["actor/skipped_steps"] == 0.0 and np.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0
    trained = [dtype for dtype, grad in seen if grad]
    assert trained and set(trained) == {torch.bfloat16}  # every projection and the head, with gradients
    assert {dtype for dtype, grad in seen if not grad} == {torch.bfloat16}  # the old-logprob recompute
    params = list(mixed.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    assert len(op.trainer.optimizer.state) == len(params)
    for state in op.trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    changed = [k for k, v in mixed.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # the float32 master weights took the (small) steps


def test_generation_runs_in_bf16_too(mixed):
    """The hybrid engine samples in the update's precision, so `source: rollout` logprobs are bf16
    ones as well; the logits are cast to float32 before sampling."""
    dtypes = []
    hook = mixed.model.lm_head.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    prompts = [mixed.tokenizer.encode(p.prompt) for p in _problems(4, "val")]
    out = mixed.generate(prompts, SamplingConfig(n=2, max_tokens=6, seed=3))
    hook.remove()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert all(lp <= 0 for row in out.logprobs for lp in row) and len(out.response_ids) == 8


def test_recomputed_old_logprobs_are_the_updates_so_ratios_start_at_1(mixed, tiny_adder_path):
    """The logprob node (inference mode, 64 rows a pass) and the update's gradient forward
    (other micro-batches, other padding) run in the same precision: identical logprobs, so the
    first optimizer step of a step sees ratio 1 (ppo_kl 0, nothing clipped). Float32 old
    logprobs against the bf16 forward would be off by far more than float rounding."""
    batch = _with_old_logp(mixed, _batch(mixed, _problems(24)))
    old = batch.column(C.OLD_LOGP).to_pylist()
    prompts, responses = (batch.column(c).to_pylist() for c in (C.PROMPT_IDS, C.RESPONSE_IDS))
    for start in range(0, len(prompts), 5):  # the update's micro-batches of 5 rows
        logp, _, mask = mixed.response_logprobs(prompts[start:start + 5], responses[start:start + 5], grad=True)
        want = torch.zeros_like(logp)
        for i, values in enumerate(old[start:start + 5]):
            want[i, :len(values)] = torch.tensor(values)
        torch.testing.assert_close(logp.detach()[mask], want[mask], rtol=0, atol=1e-6)

    row = _update(mixed, micro_batch_size=5)(batch).to_pylist()[0]
    assert row["actor/ppo_kl"] == 0.0 and row["actor/clipfrac"] == 0.0 and row["actor/clipfrac_lower"] == 0.0

    full = HFPolicy(tiny_adder_path)  # the same weights in float32 throughout
    fp32_old, _, mask = full.response_logprobs(prompts, responses)
    bf16_old, _, _ = mixed.response_logprobs(prompts, responses)
    assert float((fp32_old - bf16_old)[mask].abs().max()) > 1e-3


def test_chunked_logprobs_under_autocast_match_the_unchunked_path(tiny_adder_path, mixed):
    """train.logprob_chunk_tokens with bf16: the chunks' logits are the bf16 ones, cast to float32
    for the log-softmax, and their backward recomputes them in the forward's autocast state: the
    same logprobs, the same gradients below the head; the head's own gradient sums the chunks'
    bf16 products in float32 (one bf16 matmul in the unchunked path)."""
    chunked = HFPolicy(tiny_adder_path, trainable=True, mixed_precision="bf16", logprob_chunk_tokens=5)
    batch = _batch(mixed, _problems(12))
    prompts, responses = (batch.column(c).to_pylist() for c in (C.PROMPT_IDS, C.RESPONSE_IDS))
    out = {}
    for name, policy in (("whole", mixed), ("chunked", chunked)):
        logp, entropy, mask = policy.response_logprobs(prompts, responses, grad=True, with_entropy=True)
        assert logp.dtype == entropy.dtype == torch.float32
        (logp[mask].sum() + 0.1 * entropy[mask].sum()).backward()
        out[name] = logp.detach(), {k: p.grad for k, p in policy.model.named_parameters()}
    torch.testing.assert_close(out["chunked"][0], out["whole"][0], rtol=0, atol=1e-6)
    for name, grad in out["whole"][1].items():
        got = out["chunked"][1][name]
        assert got.dtype == torch.float32
        rel = float((got - grad).norm() / grad.norm())
        assert rel < (1e-2 if name == "lm_head.weight" else 1e-4), (name, rel)


def _greedy_accuracy(policy: HFPolicy, problems) -> float:
    prompts = [policy.tokenizer.encode(p.prompt) for p in problems]
    out = policy.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=6))
    want = [policy.tokenizer.encode(p.answer, add_special_tokens=False) + [policy.eos_id] for p in problems]
    return float(np.mean([got == w for got, w in zip(out.response_ids, want)]))


def _learn(policy: HFPolicy, spec: ModelSpec, problems) -> tuple[tuple[float, float], tuple[float, float]]:
    """(mean logprob of the right answers, greedy accuracy) before and after 8 RL steps of the
    update op on a fixed batch: each problem's right answer with advantage +1 (a verifier's
    reward on a correct sample), old logprobs recomputed every step as the logprob node does."""
    batch = _batch(policy, problems, wrong=False)

    def measure() -> tuple[float, float]:
        logp = _with_old_logp(policy, batch).column(C.OLD_LOGP).to_pylist()
        return float(np.mean([sum(row) for row in logp])), _greedy_accuracy(policy, problems)

    start = measure()
    op = _update(policy, spec, lr=3e-5, mini_batches=2, micro_batch_size=8)
    for _ in range(8):
        row = op(_with_old_logp(policy, batch)).to_pylist()[0]
        assert row["actor/skipped_steps"] == 0.0
    return start, measure()


def test_a_bf16_policy_learns_as_a_float32_one_does(mixed, tiny_adder_path):
    """The same policy-gradient steps in bf16 mixed precision and in float32 raise the right
    answers' logprob (measured: -1.648 -> -1.160 nats in bf16, -1.649 -> -1.150 in float32) and
    the greedy accuracy (0.875 -> 1.0 both) by about as much; the weights stay float32."""
    problems = _problems(16)
    (bf16_start, bf16_acc0), (bf16_end, bf16_acc1) = _learn(mixed, MIXED, problems)
    (fp32_start, _), (fp32_end, _) = _learn(HFPolicy(tiny_adder_path, trainable=True),
                                            ModelSpec(path="builtin:tiny-adder"), problems)
    assert bf16_end > bf16_start + 0.3, (bf16_start, bf16_end)
    assert bf16_end - bf16_start > 0.8 * (fp32_end - fp32_start), (bf16_start, bf16_end, fp32_start, fp32_end)
    assert bf16_acc1 > bf16_acc0, (bf16_acc0, bf16_acc1)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())


def test_the_spec_setting_reaches_the_policy_and_fsdp2_keeps_its_own(tiny_adder_path):
    from dapo_flow.runtime.resources import load_resource

    res = load_resource("policy", MIXED, path=None, trainable=True, generates=True, scores=True, seed=0)
    assert res.policy.mixed_precision == "bf16" and res.generator is res.policy  # hf: the hybrid engine
    plain = load_resource("policy", ModelSpec(path="builtin:tiny-adder"), path=None, trainable=True,
                          generates=False, scores=True, seed=0)
    assert plain.policy.mixed_precision is None
    with pytest.raises(ModelError, match="pass mixed_precision to shard"):
        res.policy.shard(mixed_precision="bf16")  # refused before any process group is needed
    with pytest.raises(ModelError, match="mixed_precision 'fp8'"):
        HFPolicy(tiny_adder_path, mixed_precision="fp8")


def test_a_bfloat16_model_trains_float32_master_weights_and_its_other_copies_stay_bfloat16(tiny_adder_path):
    """dtype: bfloat16 with mixed_precision: bf16 (strategy none), as verl's actor: the copy an
    update trains is loaded in float32, so its parameters, gradients and AdamW state are float32
    and its forwards compute in bf16; a copy that is not trained (a rollout actor's, a
    reference's) loads bfloat16."""
    from dapo_flow.runtime.resources import load_resource, trained_dtype

    spec = ModelSpec(path="builtin:tiny-adder", dtype="bfloat16", train={"mixed_precision": "bf16"})
    unmixed = ModelSpec(path="builtin:tiny-adder", dtype="bfloat16")
    assert trained_dtype(spec) == "float32" and trained_dtype(unmixed) == "bfloat16"
    res = load_resource("policy", spec, path=None, trainable=True, generates=True, scores=True, seed=0)
    trainer = res.policy
    assert res.generator is trainer and trainer.mixed_precision == "bf16"  # hf: the hybrid engine
    assert all(p.dtype == torch.float32 and p.requires_grad for p in trainer.model.parameters())
    seen = []
    hook = trainer.model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    op = _update(trainer, spec)
    row = op(_with_old_logp(trainer, _batch(trainer, _problems(4)))).to_pylist()[0]
    hook.remove()
    assert row["actor/skipped_steps"] == 0.0 and set(seen) == {torch.bfloat16}
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    assert len(op.trainer.optimizer.state) == len(params)
    for state in op.trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32

    for trainable, generates, scores in ((False, True, False), (False, False, True)):  # rollout actor, scorer
        other = load_resource("policy", spec, path=None, trainable=trainable, generates=generates,
                              scores=scores, seed=0).policy
        assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in other.model.parameters())
    plain = load_resource("policy", unmixed, path=None, trainable=True,
                          generates=False, scores=True, seed=0).policy
    assert all(p.dtype == torch.bfloat16 for p in plain.model.parameters())  # no mixed precision: dtype


def test_a_weight_sync_casts_float32_master_weights_into_a_bfloat16_copy(tiny_adder_path):
    """An fp32 trainer's weights (streamed tensors in one actor, float32 arrays between actors)
    load into a bfloat16 HFPolicy as its own dtype: each the trainer's weight rounded to bf16."""
    trainer = HFPolicy(tiny_adder_path, trainable=True)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)  # weights no bf16 copy of the original holds
    for weights in (trainer.iter_weights(), trainer.named_weights()):
        copy = HFPolicy(tiny_adder_path, dtype="bfloat16")
        copy.load_weights(weights)
        got = copy.model.state_dict()
        for name, value in trainer.model.state_dict().items():
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], value.to(torch.bfloat16)), name
    prompts = [trainer.tokenizer.encode(p.prompt) for p in _problems(4, "val")]
    assert len(copy.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=4)).response_ids) == 4


FSDP2_WORLD_OF_ONE = """
import socket, sys, torch
torch.set_num_threads(1)
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models import fsdp
from dapo_flow.runtime.resources import load_resource
from dapo_flow.core.ports import free_port
fsdp.init_group(0, 1, "127.0.0.1", free_port())
spec = ModelSpec(path="builtin:tiny-adder", dtype="bfloat16",
                 train={"mixed_precision": "bf16", "strategy": "fsdp2"})
policy = load_resource("policy", spec, path=None, trainable=True, generates=False, scores=True,
                       seed=0, strategy="fsdp2").policy
assert policy.sharded and policy.mixed_precision is None  # FSDP2's own policy, not autocast
params = list(policy.model.parameters())
assert all(p.to_local().dtype == torch.float32 for p in params), {p.dtype for p in params}
seen = []
policy.model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
logp, _, mask = policy.response_logprobs([[1, 5, 6]], [[7, 8]], grad=True)
logp[mask].sum().backward()
optimizer = torch.optim.AdamW(params, lr=1e-3)
optimizer.step()
assert set(seen) == {torch.bfloat16}, seen
assert all(p.grad.to_local().dtype == torch.float32 for p in params)
assert all(st["exp_avg"].to_local().dtype == torch.float32 for st in optimizer.state.values())
fsdp.destroy_group()
print("ok")
"""


@pytest.mark.slow
def test_fsdp2_shards_of_a_bfloat16_model_are_float32_master_weights(tiny_adder_path):
    """strategy fsdp2, dtype bfloat16, mixed_precision bf16 (the 7B recipe's setting): a one-worker
    gloo group in a subprocess; its shards, gradients and AdamW state are float32, its compute bf16."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FSDP2_WORLD_OF_ONE], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


# the first CPU type a machine is (tests/figures.py): an AMX Xeon before any Xeon
BF16_FIGURES = {"AMD EPYC (AVX-512)": ("0.226", "0.306"), "Intel Xeon (AMX)": ("0.225", "0.319"),
                "Intel Xeon": ("0.225", "0.325")}


@pytest.mark.slow
@pytest.mark.figures  # docs/results.md prints its figures; the bf16 update's numerics are checked in the suite
def test_the_dapo_graph_learns_in_bf16_mixed_precision(tmp_path, monkeypatch):
    """graphs/dapo.yaml, 80 steps on the local executor (its 2-worker DDP group as the one worker
    it equals) with train.mixed_precision: bf16: held-out accuracy (avg@4 on 200 prompts) rises.
    Measured at 80 steps (BF16_FIGURES): a 2-core AMD EPYC (AVX-512) 0.226 -> 0.306 (~20 s), a
    2-core Intel Xeon, whose bf16 kernels round otherwise, 0.225 -> 0.325 (33 s), one with AMX
    0.225 -> 0.319 (26 s); at 40 steps the Intel Xeon gained only 0.0125, hence 80."""
    from pathlib import Path

    from rich.console import Console

    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime import execute

    graph = Path(__file__).resolve().parents[2] / "graphs" / "dapo.yaml"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    edits = parse_cli_edits([("set", "models.policy.train.mixed_precision=bf16"), ("set", "run.val_every=80"),
                             ("set", "run.checkpoint_every=80")])
    placed = edit_file(str(graph), edits).compile(Cluster(cpus=2))
    summary = execute(placed, executor="local", steps=80, console=Console(file=open(tmp_path / "log.txt", "w")))
    # deterministic on a CPU type: its figures exactly where measured, a clear gain anywhere
    assert_figures(start_end(summary), BF16_FIGURES, "bf16 graphs/dapo.yaml, 80 steps")
    assert summary["val_acc_end"] - summary["val_acc_start"] >= 0.06, summary
