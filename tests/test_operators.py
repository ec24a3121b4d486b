"""CPU operators called directly on Arrow tables: the numbers they write are algos' numbers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_flow import algos
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, requires, resolve
from dapo_flow.graph.registry import OPERATORS


def _table(scores, prompt_ids, lengths, acc=None) -> pa.Table:
    cols = {
        C.PROMPT_ID: pa.array(prompt_ids, pa.string()),
        C.SCORE: pa.array(np.asarray(scores, np.float32)),
        C.RESPONSE_LEN: pa.array(np.asarray(lengths, np.int32)),
    }
    if acc is not None:
        cols[C.ACC] = pa.array(np.asarray(acc, np.float32))
    return pa.table(cols)


def _op(name: str, **params):
    cls = OPERATORS[name]
    return cls(cls.Params(**params), OpContext(node_id=name))


BATCH = _table(
    scores=[1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.7, 0.7, 2.0],
    prompt_ids=["a", "a", "a", "b", "b", "b", "c", "c", "d"],
    lengths=[3, 8, 5, 2, 7, 7, 4, 6, 1],
    acc=[1, 0, 1, 1, 0, 0, 1, 1, 1],
)


def test_overlong_shape_adds_penalty_to_score():
    out = _op("overlong-shape", max_len=8, buffer_len=4, factor=1.0)(BATCH)
    # expected length 8 - 4 = 4: L=5 -> -0.25, L=6 -> -0.5, L=7 -> -0.75, L=8 -> -1; L<=4 -> 0
    penalty = np.array([0, -1, -0.25, 0, -0.75, -0.75, 0, -0.5, 0], np.float32)
    assert np.array_equal(out.column(C.OVERLONG_PENALTY).to_numpy(), penalty)
    assert np.allclose(out.column(C.REWARD).to_numpy(), BATCH.column(C.SCORE).to_numpy() + penalty)
    assert out.column(C.ACC).equals(BATCH.column(C.ACC))  # acc keeps the score before the penalty
    half = _op("overlong-shape", max_len=8, buffer_len=4, factor=0.5)(BATCH)  # factor 1 scales nothing
    assert np.array_equal(half.column(C.OVERLONG_PENALTY).to_numpy(), penalty / 2)


@pytest.mark.parametrize("norm_by_std", [True, False])  # False: Dr.GRPO (grpo, grpo_passk read it)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline", "grpo_passk", "opo"])
def test_advantage_op_is_sequence_advantages(estimator, norm_by_std):
    batch = BATCH.slice(0, 8)  # grpo_passk needs >= 2 per group
    out = _op("advantage", estimator=estimator, reward_column="score", norm_by_std=norm_by_std)(batch)
    expected = algos.sequence_advantages(
        batch.column(C.SCORE).to_numpy(), batch.column(C.PROMPT_ID).to_pylist(), estimator,
        lengths=batch.column(C.RESPONSE_LEN).to_numpy(), norm_by_std=norm_by_std,
    )
    assert np.array_equal(out.column(C.ADVANTAGE).to_numpy(), expected)
    assert out.schema.field(C.ADVANTAGE).type == pa.float32()


def test_advantage_reward_column_auto_follows_upstream():
    cls = OPERATORS["advantage"]
    auto = cls.Params()
    assert auto.reward_column == "auto"
    with_shaping = resolve(cls, auto, {C.SCORE: pa.float32(), C.REWARD: pa.float32()})
    without = resolve(cls, auto, {C.SCORE: pa.float32()})
    assert (with_shaping.reward_column, without.reward_column) == ("reward", "score")
    assert C.SCORE in requires(cls, without) and C.REWARD in requires(cls, with_shaping)
    explicit = cls.Params(reward_column="reward")
    assert resolve(cls, explicit, {C.SCORE: pa.float32()}) == explicit  # an explicit choice stays
    # the op reads the resolved column: shaped rewards give different advantages than scores
    shaped = _op("overlong-shape", max_len=8, buffer_len=4)(BATCH)
    adv_reward = cls(with_shaping, OpContext("adv"))(shaped).column(C.ADVANTAGE).to_numpy()
    adv_score = cls(without, OpContext("adv"))(shaped).column(C.ADVANTAGE).to_numpy()
    assert not np.array_equal(adv_reward, adv_score)


def test_group_filter_drops_constant_groups_keeps_singletons():
    out = _op("group-filter", metric="acc")(BATCH)
    # a: acc 1,0,1 kept; b: 1,0,0 kept; c: 1,1 dropped; d: singleton kept
    assert out.column(C.PROMPT_ID).to_pylist() == ["a", "a", "a", "b", "b", "b", "d"]
    shaped = _op("overlong-shape", max_len=8, buffer_len=4)(BATCH)
    # c is all-correct but its members got different penalties: kept on the shaped reward
    kept = _op("group-filter", metric="reward")(shaped).column(C.PROMPT_ID).to_pylist()
    assert kept.count("c") == 2


def _logp_table(scores, logp, ref, truncated=None) -> pa.Table:
    t = pa.table({
        C.PROMPT_ID: pa.array(["a"] * len(scores)),
        C.SCORE: pa.array(np.asarray(scores, np.float32)),
        C.OLD_LOGP: pa.array(logp, C.SCHEMA[C.OLD_LOGP]),
        C.REF_LOGP: pa.array(ref, C.SCHEMA[C.REF_LOGP]),
    })
    if truncated is not None:
        t = t.append_column(C.TRUNCATED, pa.array(truncated, pa.bool_()))
    return t


def test_kl_op_penalizes_the_summed_token_kl():
    # row 0: logp - ref = [0.5, -0.25] -> k1 sum 0.25; row 1: [1.0] -> 1.0 (ragged: one token)
    batch = _logp_table([1.0, -1.0], [[-1.0, -2.0], [-0.5]], [[-1.5, -1.75], [-1.5]])
    op = _op("kl", kind="kl", coef=0.1, reward_column="score")
    out = op(batch)
    assert np.allclose(out.column(C.KL).to_numpy(), [0.25, 1.0])
    assert np.allclose(out.column(C.REWARD).to_numpy(), [1.0 - 0.025, -1.0 - 0.1])
    # verl's controller input: mean over rows of each row's token-mean KL = (0.125 + 1.0) / 2
    assert op.last_metrics() == pytest.approx({"kl/reward_penalty": 0.5625, "kl/coef": 0.1})
    assert op.coef == 0.1  # fixed coefficient without target_kl
    # another estimator (every other test uses kl, the default): mse, 0.5 d^2 summed per row
    mse = _op("kl", kind="mse", coef=0.1, reward_column="score")(batch)
    assert np.allclose(mse.column(C.KL).to_numpy(), [0.5 * (0.25 + 0.0625), 0.5])


def test_kl_op_adaptive_coef_follows_verl_and_is_checkpointed():
    batch = _logp_table([1.0, -1.0], [[-1.0, -2.0], [-0.5]], [[-1.5, -1.75], [-1.5]])
    op = _op("kl", coef=0.1, target_kl=0.25, horizon=10, reward_column="score")
    op(batch)
    # current 0.5625 / target 0.25 - 1 = 1.25 -> clipped to 0.2; x (1 + 0.2 * 2 rows / 10)
    assert op.coef == pytest.approx(0.1 * 1.04)
    assert op.last_metrics()["kl/coef"] == 0.1  # the coefficient this step used
    fresh = _op("kl", coef=0.1, target_kl=0.25, horizon=10, reward_column="score")
    fresh.load_state_dict(op.state_dict())
    assert fresh.coef == op.coef


def test_overlong_filter_masks_truncated_rows_and_ands_upstream_masks():
    batch = _logp_table([1, 1, 1], [[0.0, 0.0]] * 3, [[0.0, 0.0]] * 3, truncated=[False, True, False])
    batch = batch.append_column(C.RESPONSE_LEN, pa.array([2, 2, 1], pa.int32()))
    out = _op("overlong-filter")(batch)
    assert out.column(C.LOSS_MASK).to_pylist() == [[1, 1], [0, 0], [1]]  # per token, to each length
    assert out.schema.field(C.LOSS_MASK).type == C.TOKEN_FLAGS
    # an upstream mask (a multi-turn response's tool token) is kept on the rows that pass
    upstream = pa.array([[1, 0], [1, 1], [1]], C.TOKEN_FLAGS)
    again = _op("overlong-filter")(out.set_column(out.schema.get_field_index(C.LOSS_MASK), C.LOSS_MASK, upstream))
    assert again.column(C.LOSS_MASK).to_pylist() == [[1, 0], [0, 0], [1]]


def test_update_uses_loss_mask_when_upstream_makes_it():
    cls = OPERATORS["update"]
    assert resolve(cls, cls.Params(), {C.LOSS_MASK: C.TOKEN_FLAGS}).loss_mask == "use"
    assert resolve(cls, cls.Params(), {}).loss_mask == "ignore"
    assert C.LOSS_MASK in requires(cls, cls.Params(loss_mask="use"))
    assert C.LOSS_MASK not in requires(cls, cls.Params(loss_mask="ignore"))


# --- score: a reward function's value is checked, never trusted -------------------------

REWARDS = '''
import math
def none(text, truth, extra): return None
def nan(text, truth, extra): return math.nan
def inf(text, truth, extra): return -math.inf
def text(text, truth, extra): return "1.0"
def pair(text, truth, extra): return [1.0, 0.0]
def huge(text, truth, extra): return 1e300
def no_score(text, truth, extra): return {"acc": 1.0}
def nan_acc(text, truth, extra): return {"score": 1.0, "acc": math.nan}
def boom(text, truth, extra): raise ZeroDivisionError("cannot parse")
def fine(text, truth, extra): return {"score": 0.5, "acc": True}
'''


def _rollouts(n: int = 3) -> pa.Table:
    return pa.table({
        C.PROMPT_ID: pa.array([f"train-{i // 2}" for i in range(n)]),
        C.SAMPLE_IDX: pa.array([i % 2 for i in range(n)], pa.int32()),
        C.RESPONSE_TEXT: pa.array(["12", "7", "x"][:n]),
        C.GROUND_TRUTH: pa.array(["12"] * n),
    })


@pytest.mark.parametrize("fn, shown", [
    ("none", "returned None as 'score'"), ("nan", "returned nan as 'score'"),
    ("inf", "returned -inf as 'score'"), ("text", "returned '1.0' as 'score'"),
    ("pair", "returned [1.0, 0.0] as 'score'"), ("huge", "returned 1e+300 as 'score'"),
    ("no_score", "returned a dict without 'score': {'acc': 1.0}"),
    ("nan_acc", "returned nan as 'acc'"), ("boom", "raised ZeroDivisionError('cannot parse')"),
])
def test_score_rejects_a_bad_reward_value_naming_function_and_sample(tmp_path, fn, shown):
    from dapo_flow.errors import RunError

    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    op = _op("score", reward=f"{rewards}:{fn}")
    with pytest.raises(RunError) as err:
        op(_rollouts())
    text = str(err.value)
    assert f"reward function '{rewards}:{fn}' (node 'score') {shown} for prompt id 'train-0', sample 0" in text
    assert "response '12'" in text and "fix:" in text


def test_score_accepts_numpy_and_bool_values(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    out = _op("score", reward=f"{rewards}:fine")(_rollouts())
    assert out.column(C.SCORE).to_pylist() == [0.5] * 3 and out.column(C.ACC).to_pylist() == [1.0] * 3
    from dapo_flow.operators.score import as_number

    assert as_number(np.float64(2.5)) == 2.5 and as_number(np.bool_(True)) == 1.0
    assert as_number(np.array(3)) == 3.0 and as_number(np.array([1, 2])) is None
    assert as_number(10**400) is None and as_number("2") is None


def test_score_rejects_a_reward_that_is_not_a_function(tmp_path):
    from dapo_flow.errors import RunError

    rewards = tmp_path / "rewards.py"
    rewards.write_text("SCORE = 1.0\n")
    with pytest.raises(RunError, match=r"is a float, not a function"):
        _op("score", reward=f"{rewards}:SCORE")


# --- update: non-finite optimizer steps are skipped, counted, and stop the run -----------


def _train_batch(policy, rows: int = 4) -> pa.Table:
    prompts = [policy.tokenizer.encode(f"{i}+{i}=") for i in range(rows)]
    responses = [policy.tokenizer.encode(str(2 * i)) + [policy.eos_id] for i in range(rows)]
    return pa.table({
        C.PROMPT_IDS: pa.array(prompts, C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.OLD_LOGP: pa.array([[-1.0] * len(r) for r in responses], C.TOKEN_FLOATS),
        C.ADVANTAGE: pa.array(np.linspace(-1, 1, rows, dtype=np.float32)),
    })


@pytest.fixture()
def policy(tiny_adder_path):
    from dapo_flow.models.hf import HFPolicy

    return HFPolicy(tiny_adder_path, trainable=True)


def _update(policy, max_tokens_per_micro_batch=None, **params):
    from types import SimpleNamespace

    from dapo_flow.graph.spec import ModelSpec

    spec = ModelSpec(path="builtin:tiny-adder", train={"max_tokens_per_micro_batch": max_tokens_per_micro_batch})
    cls = OPERATORS["update"]
    return cls(cls.Params(lr=1e-3, **params), OpContext("train", model=SimpleNamespace(policy=policy, spec=spec)))


def test_update_counts_nonfinite_steps_and_stops_after_k_in_a_row(policy):
    from dapo_flow.errors import RunError

    batch = _train_batch(policy)
    before = [p.detach().clone() for p in policy.model.parameters()]
    op = _update(policy, entropy_coef=1e38, max_nonfinite_steps=3)  # the loss overflows: grad nan
    for total in (1.0, 2.0):
        row = op(batch).to_pylist()[0]
        assert row["actor/skipped_steps"] == 1.0 and row["actor/skipped_steps_total"] == total
        assert np.isnan(row["actor/grad_norm"])
    assert all(bool((a == b).all()) for a, b in zip(before, policy.model.parameters()))  # nothing trained
    resumed = _update(policy, entropy_coef=1e38, max_nonfinite_steps=3)
    resumed.load_state_dict(op.state_dict())  # the count in a row survives a checkpoint
    with pytest.raises(RunError) as err:
        resumed(batch)
    text = str(err.value)
    assert "update 'train': the gradient norm was nan (not finite) in 3 optimizer steps in a row" in text
    assert "entropy_coef" in text and "--resume" in text and "checkpoints written so far are intact" in text


def test_update_finite_step_resets_the_count_and_zero_never_stops(policy):
    batch = _train_batch(policy)
    op = _update(policy, entropy_coef=1e38, max_nonfinite_steps=2)
    op(batch)
    assert op.trainer.nonfinite_in_a_row == 1
    op.params = op.params.model_copy(update={"entropy_coef": 0.0})
    row = op(batch).to_pylist()[0]
    assert row["actor/skipped_steps"] == 0.0 and row["actor/skipped_steps_total"] == 1.0
    assert op.trainer.nonfinite_in_a_row == 0 and np.isfinite(row["actor/grad_norm"])
    never = _update(policy, entropy_coef=1e38, max_nonfinite_steps=0, mini_batches=2)
    for _ in range(4):
        row = never(batch).to_pylist()[0]
    assert row["actor/skipped_steps"] == 2.0 and row["actor/skipped_steps_total"] == 8.0


def test_update_stops_after_k_steps_with_every_response_masked(policy):
    from dapo_flow.errors import RunError

    batch = _train_batch(policy)
    truncated = batch.append_column(C.TRUNCATED, pa.array([True] * batch.num_rows))
    op = _update(policy, mask_truncated=True, max_empty_steps=2, mini_batches=2)
    row = op(truncated).to_pylist()[0]
    assert row["actor/skipped_minibatches"] == 2.0 and op.trainer.empty_in_a_row == 1
    op(batch.append_column(C.TRUNCATED, pa.array([False] * batch.num_rows)))  # trains: resets
    assert op.trainer.empty_in_a_row == 0
    op(truncated)
    resumed = _update(policy, mask_truncated=True, max_empty_steps=2, mini_batches=2)
    resumed.load_state_dict(op.state_dict())
    with pytest.raises(RunError, match=r"update 'train': no token was left to train on in 2 steps in a row"):
        resumed(truncated)


def test_update_empty_batch_is_a_user_facing_error(policy):
    from dapo_flow.errors import DapoFlowError

    with pytest.raises(DapoFlowError, match=r"update 'train' got an empty batch"):
        _update(policy)(_train_batch(policy).slice(0, 0))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_token_budget_gives_the_update_that_row_micro_batches_give(tiny_adder_path, agg):
    """`models.X.train.max_tokens_per_micro_batch` cuts a mini-batch by tokens instead of rows;
    losses are normalised by the mini-batch's token count (token-mean) or sequence count
    (seq-mean: each micro-batch's rows are a share of the mini-batch's, not a mean of their own;
    token-mean alone never reads that count), so the update is the same."""
    from dapo_flow.models.hf import HFPolicy

    results = []
    for budget, rows in ((None, 64), (None, 3), (20, 64)):
        torch.manual_seed(0)
        policy = HFPolicy(tiny_adder_path, trainable=True)
        op = _update(policy, max_tokens_per_micro_batch=budget, micro_batch_size=rows, mini_batches=2,
                     loss_agg_mode=agg)
        splits = []
        real = policy.response_logprobs
        policy.response_logprobs = lambda p, r, **kw: (splits.append(len(p)), real(p, r, **kw))[1]
        metrics = op(_train_batch(policy, rows=16)).to_pylist()[0]
        results.append((splits, metrics, [q.detach().clone() for q in policy.model.parameters()]))
    (one, m1, w1), (by_rows, _, w2), (by_tokens, m3, w3) = results
    assert len(one) == 2 and len(by_rows) > 2 and len(by_tokens) > 2  # the budget did cut
    assert abs(m1["actor/pg_loss"] - m3["actor/pg_loss"]) < 1e-5
    for a, b, c in zip(w1, w2, w3):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=0)


def test_ppo_epochs_are_passes_over_the_batch(tiny_adder_path):
    """`ppo_epochs: 2` takes the optimizer steps of two RL steps on the same batch (the lr constant,
    no shuffle): the same weights, and metrics averaged over them. (The only other test with
    epochs compares a training group with one worker, which would share a lost epoch.)"""
    from dapo_flow.models.hf import HFPolicy

    after = []
    for epochs, calls in ((2, 1), (1, 2), (1, 1)):
        torch.manual_seed(0)
        policy = HFPolicy(tiny_adder_path, trainable=True)
        op = _update(policy, ppo_epochs=epochs, mini_batches=2)
        batch = _train_batch(policy, rows=6)
        rows = [op(batch).to_pylist()[0] for _ in range(calls)]
        after.append((rows, [q.detach().clone() for q in policy.model.parameters()]))
    (two_epochs, w_two), (two_calls, w_calls), (_, w_one) = after
    assert all(torch.equal(a, b) for a, b in zip(w_two, w_calls))
    assert not all(torch.equal(a, b) for a, b in zip(w_two, w_one))
    mean_loss = (two_calls[0]["actor/pg_loss"] + two_calls[1]["actor/pg_loss"]) / 2
    assert two_epochs[0]["actor/pg_loss"] == pytest.approx(mean_loss, rel=1e-5, abs=1e-7)


def test_the_lr_warms_up_linearly_over_rl_steps(tiny_adder_path):
    """`warmup_steps: 2`: RL step k's optimizer steps (2 mini-batches here) train at lr x
    min(1, k / 2), as AdamW sees it at each step; every other test trains without warm-up."""
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(tiny_adder_path, trainable=True)
    op = _update(policy, warmup_steps=2, mini_batches=2)
    trained_at = []
    op.trainer.optimizer.register_step_pre_hook(lambda opt, *_: trained_at.append(opt.param_groups[0]["lr"]))
    batch = _train_batch(policy)
    for _ in range(3):
        op(batch)
    assert trained_at == pytest.approx([5e-4, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-6)


def test_shuffle_cuts_the_mini_batches_from_a_seeded_permutation(tiny_adder_path):
    """`shuffle: true`: each epoch's mini-batches take the rows in a permutation drawn from the
    node's seed, not in the batch's order (the other test with shuffle compares a training group
    with one worker, which would share an ignored setting)."""
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(tiny_adder_path, trainable=True)
    batch = _train_batch(policy, rows=8)
    prompts = [tuple(p) for p in batch.column(C.PROMPT_IDS).to_pylist()]
    real = policy.response_logprobs
    orders = []
    for _ in range(2):
        seen = []
        policy.response_logprobs = lambda p, r, **kw: (seen.extend(prompts.index(tuple(x)) for x in p),
                                                       real(p, r, **kw))[1]
        _update(policy, shuffle=True, mini_batches=2)(batch)
        orders.append(seen)
    assert sorted(orders[0]) == list(range(8)) and orders[0] != list(range(8))
    assert orders[1] == orders[0]  # seeded
