"""update: PPO-style policy update with DAPO's clip-higher, dual clip and loss aggregation.

ppo_epochs passes over `mini_batches` mini-batches; each mini-batch is one optimizer
step, accumulated over micro-batches whose losses are partial sums of the mini-batch
loss (verl's token-count semantics: token-mean divides by the mini-batch token count).
AdamW with linear warm-up, weight decay and grad-norm clipping; optional KL loss against
ref logprobs, entropy bonus, and overlong filtering (mask truncated responses); optional
top-K distillation: the forward KL from a teacher's top-K logprobs (a teacher `logprob` node's
``top_k``) to the student's at the same tokens, GKD's on-policy forward KL (algos/distill.py).
Returns a one-row table of metrics.

An optimizer step whose gradient norm is nan or inf is skipped (counted in
``actor/skipped_steps``); `max_nonfinite_steps` of them in a row stop the run with a RunError,
since from then on training would silently do nothing. So do `max_empty_steps` steps in a row
whose every response is masked out (``actor/skipped_minibatches`` counts such mini-batches).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, model_validator

from dapo_flow import algos
from dapo_flow.data.arrow_utils import ragged_to_padded, response_mask, routes_from_arrow, token_lists, topk_to_padded
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, TrainSizing
from dapo_flow.errors import ModelError
from dapo_flow.models.devices import host_floats
from dapo_flow.models.moe import routing_of
from dapo_flow.training import OptimizerParams, StepRows, make_trainer
from dapo_flow.training.router import RouterTerm

KLType = Literal[algos.KL_KINDS]  # type: ignore[valid-type]


class Params(OptimizerParams):
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower ratio clip: r >= 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper ratio clip (DAPO clip-higher: 0.28)."""
    clip_c: float | None = Field(10.0, gt=1.0)
    """Dual-clip constant for negative advantages; null disables it. vanilla only (the default
    is not applied to another policy_loss; setting it with one is an error)."""
    policy_loss: Literal["vanilla", "gspo", "cispo", "gpg"] = "vanilla"
    """Policy-gradient loss (verl's actor.policy_loss.loss_mode; docs/semantics.md, "Policy-loss
    family"): `vanilla`: PPO clipped surrogate with clip-higher and dual clip (DAPO); `gspo`: the
    same clip on a sequence-level ratio, the geometric mean of the token ratios (GSPO; its clip
    ranges are ~1e-4 scale, verl's example 3e-4 / 4e-4); `cispo`: REINFORCE weighted by the clipped
    token ratio under stop-gradient, so clipped tokens still get a gradient (MiniMax-M1); `gpg`:
    plain -A * logp, no ratio, no clip (GPG). All aggregate with loss_agg_mode."""
    kl_coef: float = Field(0.0, ge=0.0)
    """KL loss coefficient against ref_logp (0 = no KL; DAPO uses none)."""
    kl_type: KLType = "low_var_kl"
    """KL estimator for the loss term."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient."""
    distill_topk_coef: float = Field(0.0, ge=0.0, le=100.0)
    """Weight of the top-K distillation loss: per response token, the forward KL from a frozen
    teacher restricted to its top-K tokens, sum_k p_T(k) (log p_T(k) - log p_S(k)) (GKD's forward
    KL on the student's samples, not renormalised: algos.topk_forward_kl), aggregated with
    loss_agg_mode and logged as actor/distill_fkl. Reads teacher_topk_ids / teacher_topk_logp,
    from a teacher `logprob` node with top_k. 0: off."""
    mask_truncated: bool = False
    """Overlong filtering: truncated responses get no loss (DAPO paper, TRL's mask_truncated_completions)."""
    advantage_column: Literal["auto", "advantage", "token_advantage"] = "auto"
    """Advantages to train on: per sequence (`advantage`, broadcast over the response tokens) or
    per token (`token_advantage`, from a token-level estimator such as reinforce_pp); `auto`:
    whichever reaches this node (resolved when the graph compiles)."""
    loss_mask: Literal["auto", "use", "ignore"] = "auto"
    """Per-token `loss_mask` column (from `agent-generate`: 0 on tool tokens; from an
    `overlong-filter` node: 0 on a truncated row): `use` it (0 tokens get no loss), `ignore` it
    (trains on a tool's tokens too), or `auto`: use it when an upstream node produces it."""
    rollout_is_weights: Literal["auto", "use", "ignore"] = "auto"
    """Per-token `rollout_is_weight` column (from a `rollout-correction` node): `use` it (each
    token's policy loss times its weight, as verl's rollout correction), `ignore` it, or
    `auto`: use it when an upstream node produces it."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Divide logits by this (set it to generate's temperature)."""
    critic_warmup: int = Field(0, ge=0)
    """Leave the policy as it is for the first this many RL steps, while a critic learns the
    values its advantages come from (verl's trainer.critic_warmup)."""
    router_aux_loss_coef: float = Field(0.0, ge=0.0, le=10.0)
    """A mixture-of-experts policy's load-balancing loss weight (the model config's
    `router_aux_loss_coef` is what its pretraining used: 0.001 for Qwen3-MoE): its mean per
    sequence (algos/moe.py) times this is added to the loss. 0 (the default) trains on the RL
    objective alone and only reports the routing (moe/* metrics): RL fine-tunes a router that
    pretraining balanced, over few steps, and a balance term is a second objective the ratio
    clip does not bound; set it when moe/load_max climbs. An error on a dense model."""

    @model_validator(mode="after")
    def _dual_clip_is_vanilla_only(self) -> "Params":
        if self.policy_loss != "vanilla" and self.clip_c is not None and "clip_c" in self.model_fields_set:
            raise ValueError(
                f"clip_c (dual clip) applies to policy_loss vanilla only, but policy_loss is "
                f"{self.policy_loss} and clip_c is set to {self.clip_c}: set clip_c: null or remove it")
        return self


METRICS = (
    "actor/pg_loss", "actor/clipfrac", "actor/clipfrac_lower", "actor/ppo_kl", "actor/grad_norm",
    "actor/entropy", "actor/lr", "actor/kl_loss", "actor/skipped_minibatches",
    "actor/skipped_steps", "actor/skipped_steps_total",
)
# statistics each worker of a group computes for its share of a mini-batch (already divided by
# the group's token count): the group's value is their sum
GROUP_SUMMED = ("actor/pg_loss", "actor/entropy", "actor/clipfrac", "actor/clipfrac_lower",
                "actor/ppo_kl", "actor/kl_loss")
DISTILL_FKL = "actor/distill_fkl"  # reported (and emitted) only with distill_topk_coef > 0


def _metrics(params: Params) -> tuple[str, ...]:
    return METRICS + ((DISTILL_FKL,) if params.distill_topk_coef > 0 else ())


class Update:
    """Trains the node's model (the policy) on the batch; emits one row of metrics. The loss is
    :class:`PolicyLoss`; the optimizer steps around it are the node's trainer's
    (:mod:`dapo_flow.training`)."""

    Params = Params
    CARDINALITY = "sink"
    NEEDS_MODEL = True
    ROLE = "train"

    @classmethod
    def train_sizing(cls, params: Params) -> TrainSizing:
        return TrainSizing(params.mini_batches, params.micro_batch_size, entropy_in_loss=params.entropy_coef > 0)

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        return {name: pa.float32() for name in _metrics(params)}

    @classmethod
    def upstream_problems(cls, params: Params, generator_id: str, generator_params) -> list:
        from dapo_flow.models.sampling import temperature_problems

        return temperature_problems(params.temperature, generator_id, generator_params.temperature)

    @classmethod
    def model_problems(cls, params: Params, config: dict) -> list:
        """A load-balancing loss weight needs a model with experts (Qwen2/Qwen3-MoE's config names them)."""
        if params.router_aux_loss_coef > 0 and not (config.get("num_experts") or config.get("num_local_experts")):
            return [("router_aux_loss_coef", f"router_aux_loss_coef is {params.router_aux_loss_coef} but the "
                     f"model ({config.get('model_type', 'unknown type')}) has no experts: there is no router to balance",
                     "remove router_aux_loss_coef, or train a mixture-of-experts model (e.g. builtin:tiny-moe)")]
        return []

    @classmethod
    def resolve(cls, params: Params, available: dict[str, pa.DataType]) -> Params:
        update = {}
        if params.loss_mask == "auto":
            update["loss_mask"] = "use" if C.LOSS_MASK in available else "ignore"
        if params.rollout_is_weights == "auto":
            update["rollout_is_weights"] = "use" if C.ROLLOUT_IS_WEIGHT in available else "ignore"
        if params.advantage_column == "auto":
            token_only = C.TOKEN_ADVANTAGE in available and C.ADVANTAGE not in available
            update["advantage_column"] = C.TOKEN_ADVANTAGE if token_only else C.ADVANTAGE
        return params.model_copy(update=update) if update else params

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        cols = [C.PROMPT_IDS, C.RESPONSE_IDS, C.OLD_LOGP,
                C.TOKEN_ADVANTAGE if params.advantage_column == C.TOKEN_ADVANTAGE else C.ADVANTAGE]
        cols += [C.TRUNCATED] if params.mask_truncated else []
        cols += [C.LOSS_MASK] if params.loss_mask == "use" else []
        cols += [C.REF_LOGP] if params.kl_coef > 0 else []
        cols += [C.ROLLOUT_IS_WEIGHT] if params.rollout_is_weights == "use" else []
        cols += [C.TEACHER_TOPK_IDS, C.TEACHER_TOPK_LOGP] if params.distill_topk_coef > 0 else []
        return C.typed(*cols)

    def __init__(self, params: Params, ctx: OpContext):
        if params.distill_topk_coef > 0:  # before anything is built
            _check_topk_paths(ctx.node_id, ctx.model.spec.train)
        self.params = params
        self.ctx = ctx
        self.policy = ctx.model.policy  # stays in eval mode: no dropout in RL (HFPolicy)
        self.trainer = make_trainer(self.policy, params, label=f"update '{ctx.node_id}'", prefix="actor",
                                    metrics=_metrics(params), group_summed=GROUP_SUMMED + (
                                        (DISTILL_FKL,) if params.distill_topk_coef > 0 else ()), seed=ctx.seed,
                                    world_size=ctx.world_size,
                                    max_tokens_per_micro_batch=ctx.model.spec.train.max_tokens_per_micro_batch)
        self.rl_steps = 0  # calls, warm-up ones included (critic_warmup counts them)
        self.routing = routing_of(self.policy.model)  # None: a dense model
        if self.routing is None and params.router_aux_loss_coef > 0:
            raise ModelError(f"update '{ctx.node_id}': router_aux_loss_coef is {params.router_aux_loss_coef} but "
                             f"the model has no experts (no router to balance): remove router_aux_loss_coef")
        self.moe_metrics: dict[str, float] = {}
        # routing replay (R3): the forwards route as the rollout did (train.routing_replay)
        self.replay = bool(self.routing is not None and ctx.model.spec.train.routing_replay)
        if self.replay and self.policy.grad_checkpointing:  # validate says so first; a direct caller here
            raise ModelError(f"update '{ctx.node_id}': routing replay with gradient checkpointing: the "
                             "recomputed layers would route on their own; turn one of them off")

    def last_metrics(self) -> dict[str, float]:
        """A mixture-of-experts policy's router metrics of the last step (``RouterTerm.metrics``:
        as many per-expert loads as the model has experts, so not columns); {} for a dense one."""
        return self.moe_metrics

    def state_dict(self) -> dict:
        return {**self.trainer.state_dict(), "rl_steps": self.rl_steps}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state)
        self.rl_steps = int(state.get("rl_steps", self.trainer.steps_done))
        self.policy.set_weights_version(self.rl_steps)

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.rl_steps += 1
        out = self._train(batch)
        self.policy.set_weights_version(self.rl_steps)  # RL steps, as the driver counts them (warm-up too)
        return out

    def _train(self, batch: pa.Table) -> pa.Table:
        if self.rl_steps <= self.params.critic_warmup:  # the critic learns first; nothing moves
            return metrics_row(_metrics(self.params), {"actor/lr": self.trainer.lr,
                                         "actor/skipped_steps_total": float(self.trainer.skipped_total)})
        data = self._arrays(batch)
        data["routes"] = self._routes(batch)
        router = RouterTerm(self.routing, self.params.router_aux_loss_coef) if self.routing else None
        loss = PolicyLoss(self.policy, self.params, data, router)
        out = self.trainer.step(step_rows(batch, data), loss)
        if router is not None:  # a collective: every worker of a group gets here
            self.moe_metrics = router.metrics(self.trainer.parallel)
        return metrics_row(_metrics(self.params), out)

    def _routes(self, batch: pa.Table) -> list | None:
        """Each row's recorded expert choices to replay (None: replay off)."""
        if not self.replay:
            return None
        if C.ROUTED_EXPERTS not in batch.column_names:
            raise ModelError(f"update '{self.ctx.node_id}': train.routing_replay is on but the rows carry no "
                             f"{C.ROUTED_EXPERTS} column: they must come from this model's own hf `generate` "
                             "or `agent-generate`")
        return routes_from_arrow(batch.column(C.ROUTED_EXPERTS), len(self.routing.routers), self.routing.top_k)

    def _arrays(self, batch: pa.Table) -> dict:
        p = self.params
        old_logp, lengths = ragged_to_padded(batch.column(C.OLD_LOGP), dtype=np.float32)
        if p.loss_mask == "use":  # the tokens the model generated (not a tool's), rows not filtered out
            mask = response_mask(batch, lengths, old_logp.shape[1])
        else:
            mask = np.arange(old_logp.shape[1])[None, :] < lengths[:, None]
        if p.mask_truncated:
            mask &= ~batch.column(C.TRUNCATED).to_numpy(zero_copy_only=False)[:, None]
        if p.advantage_column == C.TOKEN_ADVANTAGE:  # (batch, width), 0 past each response
            adv = ragged_to_padded(batch.column(C.TOKEN_ADVANTAGE), dtype=np.float32)[0]  # as old_logp: same lengths
        else:  # (batch,): broadcast over the tokens per micro-batch
            adv = batch.column(C.ADVANTAGE).to_numpy().astype(np.float32)
        return {
            "prompts": token_lists(batch.column(C.PROMPT_IDS)),
            "responses": token_lists(batch.column(C.RESPONSE_IDS)),
            "old_logp": old_logp,
            "ref_logp": ragged_to_padded(batch.column(C.REF_LOGP), dtype=np.float32)[0] if p.kl_coef > 0 else None,
            "mask": mask,
            "adv": adv,
            "is_weights": (ragged_to_padded(batch.column(C.ROLLOUT_IS_WEIGHT), dtype=np.float32)[0]
                           if p.rollout_is_weights == "use" else None),
            # (batch, width, K) each: the teacher's top-K ids and logprobs per response token
            "teacher_topk": ((topk_to_padded(batch.column(C.TEACHER_TOPK_IDS), dtype=np.int64),
                              topk_to_padded(batch.column(C.TEACHER_TOPK_LOGP), dtype=np.float32))
                             if p.distill_topk_coef > 0 else None),
        }


class PolicyLoss:
    """The policy-gradient loss of micro-batches of one step's rows (a
    :class:`dapo_flow.training.MicroLoss`): the chosen surrogate, entropy bonus, KL loss and
    top-K distillation loss, aggregated with ``loss_agg_mode`` over the mini-batch's token and
    sequence counts."""

    def __init__(self, policy, params: Params, data: dict, router: RouterTerm | None = None):
        self.policy, self.params, self.data, self.router = policy, params, data, router

    def __call__(self, rows: np.ndarray, n_tokens: int, n_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
        p, data = self.params, self.data
        adv, ref_logp = data["adv"], data["ref_logp"]
        prompts, responses = [data["prompts"][i] for i in rows], [data["responses"][i] for i in rows]
        routes = [data["routes"][i] for i in rows] if data.get("routes") is not None else None
        # replay's arguments only with routes to replay: a policy without experts need not take them
        replay = {"routes": routes, "tally": self.router.replay if self.router else None} if routes is not None else {}
        topk = _topk_rows(data.get("teacher_topk"), rows, responses)  # (b, R, K) each, or None
        # the student's logprobs at the teacher's top-K ids come from the same forward (gathered)
        at_ids = {"at_ids": self.policy.to_device(torch.from_numpy(topk[0]))} if topk is not None else {}
        with self.router.recording() if self.router else nullcontext():
            logp, entropy, resp_mask, *student_topk = self.policy.response_logprobs(
                prompts, responses, temperature=p.temperature, with_entropy=True, grad=True, **replay, **at_ids)
        width = logp.shape[1]
        dev = self.policy.to_device({  # the batch's arrays where the model's outputs are
            "mask": data["mask"][rows, :width],
            "old": data["old_logp"][rows, :width],
            "adv": adv[rows, :width] if adv.ndim == 2 else adv[rows],
            "ref": ref_logp[rows, :width] if p.kl_coef > 0 else None,
            "is_weights": data["is_weights"][rows, :width] if data["is_weights"] is not None else None,
            "teacher_topk_logp": topk[1] if topk is not None else None,
        })
        m = dev["mask"] & resp_mask
        a = dev["adv"] if adv.ndim == 2 else dev["adv"][:, None].expand(-1, width)
        agg = dict(num_tokens=n_tokens, num_seqs=n_seqs)
        extra = {"clip_c": p.clip_c} if p.policy_loss == "vanilla" else {}  # dual clip: vanilla only
        pg_loss, pg_stats = algos.POLICY_LOSSES[p.policy_loss](
            dev["old"], logp, a, m, clip_low=p.clip_low, clip_high=p.clip_high,
            agg=p.loss_agg_mode, norm_len=p.norm_len, rollout_is_weights=dev["is_weights"], **extra, **agg,
        )
        loss = pg_loss
        stats = {"actor/pg_loss": pg_loss, "actor/entropy": algos.agg_loss(entropy.detach(), m, "token-sum") / n_tokens}
        if p.entropy_coef > 0:
            loss = loss - p.entropy_coef * algos.agg_loss(entropy, m, p.loss_agg_mode, norm_len=p.norm_len, **agg)
        if p.kl_coef > 0:
            kl = algos.kl_penalty(logp, dev["ref"], p.kl_type)
            kl_loss = algos.agg_loss(kl, m, p.loss_agg_mode, norm_len=p.norm_len, **agg)
            loss = loss + p.kl_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss
        if p.distill_topk_coef > 0:
            fkl = algos.topk_forward_kl(student_topk[0][1], dev["teacher_topk_logp"], m)
            fkl_loss = algos.agg_loss(fkl, m, p.loss_agg_mode, norm_len=p.norm_len, **agg)
            loss = loss + p.distill_topk_coef * fkl_loss
            stats[DISTILL_FKL] = fkl_loss
        balance = self.router.loss(prompts, responses, packed=self.policy.packed, n_seqs=n_seqs) if self.router else None
        if balance is not None:  # the router's load-balancing term (MoE, router_aux_loss_coef > 0)
            loss = loss + balance
        stats = host_floats({**stats, "tokens": m.sum()})  # one transfer from the device
        share = stats.pop("tokens") / n_tokens  # this micro-batch's weight in the token statistics
        for key in ("clipfrac", "clipfrac_lower", "ppo_kl"):
            stats[f"actor/{key}"] = pg_stats[key] * share
        return loss, stats

    def zero_pass(self) -> None:
        eos = self.policy.eos_id
        logp, _, _ = self.policy.response_logprobs([[eos]], [[eos]], temperature=self.params.temperature,
                                                   grad=True)
        (logp.sum() * 0.0).backward()


def _check_topk_paths(node_id: str, train) -> None:
    """Top-K distillation gathers the student's logprobs at the teacher's ids from the logits
    of its forward: the logprob paths that never hold a position's logits (chunked logprobs,
    the sequence-parallel split) cannot give them."""
    off = [(f"train.{name}", fix) for name, on, fix in (
        ("logprob_chunk_tokens", train.logprob_chunk_tokens is not None, "null"),
        ("sequence_parallel", train.sequence_parallel > 1, "1")) if on]
    if off:
        raise ModelError(f"update '{node_id}': distill_topk_coef needs the student's logits at every response "
                         f"position, which {', '.join(name for name, _ in off)} does not keep: set "
                         + ", ".join(f"{name}: {fix}" for name, fix in off) + ", or distill_topk_coef: 0")


def _topk_rows(topk: tuple[np.ndarray, np.ndarray] | None, rows: np.ndarray, responses: list[list[int]]
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """The teacher's top-K ids and logprobs of ``rows``, as wide as the policy's pass over them
    lays their responses out (the longest, at least 1; zero-padded).
    Shape: (batch, width, K) each -> (len(rows), R, K) each."""
    if topk is None:
        return None
    width = max(1, max(map(len, responses), default=1))
    out = []
    for values in topk:
        part = values[rows, :width]
        if part.shape[1] < width:
            part = np.concatenate([part, np.zeros((len(rows), width - part.shape[1], part.shape[2]), part.dtype)], 1)
        out.append(np.ascontiguousarray(part))
    return out[0], out[1]


def step_rows(batch: pa.Table, data: dict) -> StepRows:
    """What the trainer reads of a training operator's rows: ``data["mask"]`` (the tokens the
    loss counts), each row's prompt + response tokens, and its ``batch_row`` when the runtime
    numbered the group's rows."""
    positions = (batch.column(C.BATCH_ROW).to_numpy(zero_copy_only=False)
                 if C.BATCH_ROW in batch.column_names else None)
    lengths = np.array([len(p) + len(r) for p, r in zip(data["prompts"], data["responses"])], dtype=np.int64)
    return StepRows(loss_tokens=data["mask"], row_tokens=lengths, batch_row=positions)


def metrics_row(names: tuple[str, ...], values: dict[str, float]) -> pa.Table:
    """One row of float32 metrics, 0 where ``values`` has none."""
    return pa.table({k: pa.array([values.get(k, 0.0)], pa.float32()) for k in names})
