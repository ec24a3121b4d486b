"""score: verify each response against its ground truth and emit score / acc columns.

Reward functions: ``builtin:addition``, ``builtin:chain`` (the last line must be ``Answer: N``),
``builtin:tool-arith`` (the text after the last tool ``</result>``, else the whole response, is the product),
``builtin:math`` (boxed / final answer, DAPO's +1 / -1, equivalent forms through math-verify),
``builtin:tool-reward`` (the row's ``tool_reward``: what agent-generate's tools or OpenEnv
environment gave the sample; acc: it is positive), ``builtin:harness`` (harness-generate's
``harness_reward``; ``wrong`` where the harness gave none),
``builtin:reasoning-gym`` (a reasoning_gym: source's own ``score_answer`` on the last ``<answer>``,
mapped onto [wrong, correct]; ``dapo_flow/data/reasoning_gym.py``), or user code ``module:fn`` / ``file.py:fn`` taking
``(response_text, ground_truth, extra_info)`` (extra_info holds the row's ``data_source``, its
``tool_reward`` after agent-generate and ``harness_reward`` after harness-generate) and
returning a float or a dict with ``score`` (and optionally ``acc`` plus the declared
``extra_columns``). verl reward files work unchanged: a function with verl's signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` is called that way.
``acc`` is 1.0 when the answer is correct, taken before any overlong penalty.

A reward function's value is checked, never trusted: anything but a finite real number (None,
NaN, inf, a string, a list, a dict without ``score``, a value beyond float32) or an exception
raised by the function stops the run with a RunError naming the function, the sample (prompt id
and sample index) and the value. Not skipped: a silently dropped sample would bias the group's
advantages, and a bad value is a bug in the function that the user has to see.

``workers: N`` scores in N worker processes (``dapo_flow/data/reward_pool.py``), started on the
first call and kept until the operator is closed or collected; rows go in chunks and come back
in order, with the same numbers as in-process scoring. A user function is imported in every
worker from its ``module:fn`` / ``file.py:fn`` string (a relative path against the working
directory the operator was built in); it cannot use multiprocessing itself (workers are
daemons). A worker that dies (segfault, ``os._exit``) stops the run with a RunError naming the
sample it was scoring.

``timeout_s``: a sample whose function runs longer gets ``wrong`` and acc 0, and is counted in
``score/timeouts`` (reported only when a timeout is set). Its worker is killed and replaced; the
other rows of its chunk are scored again (a function with side effects may see them twice).
A timeout needs ``workers >= 1``: only killing the process it runs in stops a hung function
for sure (one stuck in C code ignores signals and a thread cannot be killed), and ``workers: 0``
promises in-process scoring, so the pair is a validation error rather than a silent process.

``reward: http://HOST:PORT`` scores on a reward server (`dapo-flow serve-reward`; the client,
its retries and ``server:`` settings: ``dapo_flow/reward_server/``): rows go in batches, several
in flight; a server that stays down, slow or wrong past ``server.retries`` stops the run with an
error naming the URL, or with ``server.on_error: mask`` its rows are masked (their group's mean
score, no advantage) and counted in ``score/masked``; ``score/server_retries`` counts resends.

``reward: {model: NAME, ...}`` scores with a reward model declared in `models:` (a sequence
classifier, `head: reward`), read at each response's last token, or with ``output: likelihood``
with a causal LM (a generative verifier or a teacher: the lowest probability it gives a response
token); the node then runs in that model's actor. With a ``rule`` too, ``combine`` says how the
two make the score (``sum``, ``rule-gated``, ``rm-only``) and ``acc`` is the rule's; without one
``acc`` is the model's verdict.
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field, field_validator, model_validator

from dapo_flow.algos import fill_from_group, lowest_token_probability
from dapo_flow.algos.metrics import source_sums
from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import token_lists, with_columns
from dapo_flow.data.reward_pool import (  # as_number: re-exported, tests and plugins use it here
    HARNESS, TOOL_REWARD_RULE, BadReward, LoadFailed, RewardPool, RewardSpec, Row, WorkerDied, as_number, evaluate,
    exit_text, resolve_reward, short as _short,
)
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG
from dapo_flow.errors import RunError
from dapo_flow.reductions import Total
from dapo_flow.reward_server.client import RewardClient, ServerSettings, check_url, is_url

__all__ = ["Params", "Score", "as_number"]


class ModelReward(BaseModel):
    """A reward model's score (a model declared in `models:` with a reward head), optionally
    combined with a rule reward."""

    model_config = PARAMS_CONFIG

    model: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")
    """Name of the reward model in `models:` (e.g. `builtin:tiny-adder-rm`, or any sequence
    classifier's directory); the node runs in its actor."""
    rule: str | None = Field(None, min_length=1)
    """A rule reward also applied (`builtin:addition`, `module:fn`, a server's `http://...`;
    `correct` / `wrong`, `workers`, `timeout_s`, `server` are its): `acc` is then the rule's."""
    combine: Literal["sum", "rule-gated", "rm-only"] = "sum"
    """With a rule: `sum`: score = RM score + rule score; `rule-gated`: the RM score where the rule
    passes (acc 1), the rule's `wrong` where it fails (a format or correctness gate); `rm-only`:
    score = the RM score, the rule only measures (acc), e.g. to see whether RL against the RM
    raises true accuracy."""
    output: Literal["logit", "probability", "likelihood"] = "logit"
    """What the model's verdict is. For a reward model (a sequence classifier): `logit`, its
    scalar as it is (verl's RM score), or `probability`: its sigmoid, the model's probability
    that the response is good, for a reward model trained with binary cross-entropy
    (builtin:tiny-adder-rm); probabilities squash the differences among responses the model
    rejects, which a group-relative advantage would otherwise amplify. `likelihood`: the model is
    a causal LM (a generative verifier such as builtin:tiny-adder-judge, or a teacher) and the
    score is the lowest probability it gives any token of the response (EOS included), in
    [0, 1]: a response it would have written itself scores near 1, one wrong token sinks it.
    The verdict (acc without a rule) is score > 0.5."""
    micro_batch_size: int = Field(64, ge=1, le=65536)
    """Rows per reward-model forward pass."""

    @field_validator("rule")
    @classmethod
    def _url(cls, value):
        return check_url(value) if value is not None and is_url(value) else value


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    reward: str | ModelReward = Field("builtin:addition")
    """`builtin:addition`, `builtin:chain`, `builtin:tool-arith`, `builtin:math`, `builtin:tool-reward`
    (the tools' / environment's reward, `tool_reward`), `builtin:harness` (the harness's, `harness_reward`),
    `builtin:reasoning-gym` (the reasoning_gym: source's own scorer), `module:fn` or `file.py:fn`;
    `http://HOST:PORT` (or https): a reward server's address (`dapo-flow serve-reward`); or
    `{model: NAME, rule: ..., combine: ...}`: a reward model's score (without a rule, `acc` is the
    model's verdict, score > 0)."""
    correct: float = Field(1.0, ge=-1e6, le=1e6)
    """Score of a correct answer (built-in verifiers; DAPO uses +1)."""
    wrong: float = Field(-1.0, ge=-1e6, le=1e6)
    """Score of a wrong answer (built-in verifiers; DAPO uses -1, use 0 for 1/0 rewards)."""
    extra_columns: tuple[str, ...] = Field(())
    """Extra float columns a user function returns in its dict (declared for schema checks);
    each is also logged as the metric ``score/extra/NAME`` (its batch mean)."""
    workers: int = Field(0, ge=0, le=256)
    """0: score in this process, row by row. N >= 1: score in a pool of N worker processes kept
    for the whole run (rows sent in chunks; start-up paid once; same numbers)."""
    timeout_s: float | None = Field(None, gt=0, le=3600)
    """Seconds a reward function may take on one sample; past it the sample gets `wrong`, acc 0
    and counts in score/timeouts, and its worker is killed and replaced. Needs workers >= 1."""
    server: ServerSettings | None = None
    """With `reward: http://...`: batch_size, concurrency, timeout_s, retries, backoff_s and
    on_error (fail | mask) of the requests to the reward server (defaults when left out)."""

    @field_validator("reward")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("names no reward: use builtin:addition, module:fn, or {model: NAME}")
        return check_url(value) if isinstance(value, str) and is_url(value) else value

    @property
    def url(self) -> str | None:
        """The reward server's address, when the rule reward is one."""
        return self.rule if self.rule is not None and is_url(self.rule) else None

    @property
    def rule(self) -> str | None:
        """The rule reward's reference, if any."""
        return self.reward.rule if isinstance(self.reward, ModelReward) else self.reward

    @model_validator(mode="after")
    def _timeout_needs_workers(self) -> "Params":
        if self.timeout_s is not None and self.workers == 0:
            raise ValueError(
                "timeout_s needs workers >= 1: a hung reward function is stopped by killing the "
                "worker process it runs in, and workers: 0 scores in this process; set workers: 1 "
                "(or more), or remove timeout_s"
            )
        if self.url is None and self.server is not None:
            raise ValueError("server: settings are for a reward server (reward: http://HOST:PORT); "
                             "remove them, or point reward at a server")
        if self.url is not None and (self.workers or self.timeout_s is not None):
            raise ValueError("workers and timeout_s run a reward function in worker processes here; "
                             "a reward server runs its own: remove them (server.timeout_s bounds a request)")
        return self


class Score:
    """Adds score, acc (and declared extras) to every rollout row."""

    Params = Params
    CARDINALITY = "map"
    NEEDS_MODEL = True  # a reward model's, with `reward: {model: NAME}` only (uses_model)
    MODEL_HEAD = "reward"
    MODEL_PARAM = ("reward", "model")  # the reward model a `reward: {model: NAME}` names
    ROLE = "reward"

    @classmethod
    def forward_rows(cls, params: Params) -> int | None:
        return params.reward.micro_batch_size if isinstance(params.reward, ModelReward) else None

    @classmethod
    def uses_model(cls, params: Params) -> bool:
        return isinstance(params.reward, ModelReward)

    @classmethod
    def model_head(cls, params: Params) -> str:
        """A causal LM for `output: likelihood`, else a reward model (a sequence classifier)."""
        reward = params.reward
        return "lm" if isinstance(reward, ModelReward) and reward.output == "likelihood" else "reward"

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        cols = [C.RESPONSE_TEXT, C.GROUND_TRUTH] if params.rule is not None else []
        cols += [C.TOOL_REWARD] if params.rule == TOOL_REWARD_RULE else []
        cols += [C.HARNESS_REWARD] if params.rule == HARNESS else []
        cols += [C.PROMPT_IDS, C.RESPONSE_IDS] if isinstance(params.reward, ModelReward) else []
        cols += [C.PROMPT_ID, C.PROMPT_TEXT] if params.url is not None else []  # sent; masks by group
        return C.typed(*cols)

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        return {**C.typed(C.SCORE, C.ACC), **{name: pa.float32() for name in params.extra_columns}}

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self.spec = RewardSpec(params.rule or "", params.correct, params.wrong, params.extra_columns,
                               base_dir=ctx.workdir or os.getcwd())
        # in the driver too: a bad reference fails here
        self.fn = resolve_reward(self.spec) if params.rule is not None and params.url is None else None
        self._pool: RewardPool | None = None
        self._client: RewardClient | None = None  # started on first use (holds threads, sockets)
        self._retries = 0
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        reward = self.params.reward
        if not isinstance(reward, ModelReward):
            return self._rule(batch)
        rm = self._model_scores(reward, token_lists(batch.column(C.PROMPT_IDS)),
                                token_lists(batch.column(C.RESPONSE_IDS)))
        if reward.rule is None:  # the model's own verdict
            threshold = 0.0 if reward.output == "logit" else 0.5
            score, acc, extras = rm, (rm > threshold).astype(np.float32), {}
            self._metrics = {}
        else:
            ruled = self._rule(batch)
            rule_score, acc = (ruled.column(c).to_numpy().astype(np.float32) for c in (C.SCORE, C.ACC))
            extras = {name: ruled.column(name) for name in self.params.extra_columns}
            score = {"sum": rm + rule_score, "rm-only": rm,
                     "rule-gated": np.where(acc > 0, rm, np.float32(self.params.wrong))}[reward.combine]
            self._metrics["score/rule_mean"] = float(rule_score.mean()) if len(rule_score) else 0.0
        score = score.astype(np.float32)
        self._metrics.update({"score/mean": float(score.mean()) if len(score) else 0.0,
                              "acc/mean": float(acc.mean()) if len(acc) else 0.0,
                              "score/rm_mean": float(rm.mean()) if len(rm) else 0.0})
        return with_columns(batch, {C.SCORE: score, C.ACC: acc, **extras})

    def _model_scores(self, reward: ModelReward, prompts: list[list[int]], responses: list[list[int]]) -> np.ndarray:
        """The model's score of each response (see ``ModelReward.output``). Shape: -> (B,) float32."""
        model = self.ctx.model.policy
        if reward.output == "likelihood":
            logp, _, mask = model.response_logprobs(prompts, responses, micro_batch_size=reward.micro_batch_size)
            return lowest_token_probability(logp, mask).numpy()  # inference results are on the host
        rm = model.response_scores(prompts, responses, micro_batch_size=reward.micro_batch_size).numpy()
        if reward.output == "probability":
            rm = 1.0 / (1.0 + np.exp(-rm.astype(np.float64)))
        return rm.astype(np.float32)

    def _rule(self, batch: pa.Table) -> pa.Table:
        """score / acc (and extras) of the rule reward, row by row or in the worker pool."""
        texts = batch.column(C.RESPONSE_TEXT).to_pylist()
        truths = batch.column(C.GROUND_TRUTH).to_pylist()
        extras = _extra_infos(batch)
        masked = np.zeros(len(texts), bool)
        if self.params.url is not None:
            rows, masked = self._remote(batch, texts, truths, extras)
        elif self.params.workers:
            rows = self._pooled(batch, texts, truths, extras)
        else:
            rows = [self._evaluate(batch, i, text, truth, extra)
                    for i, (text, truth, extra) in enumerate(zip(texts, truths, extras))]
        for i, row in enumerate(rows):  # the first bad row, as in-process scoring stops at it
            if isinstance(row, str):
                raise RunError(self._bad(batch, i, row))
        timed_out = sum(row is None for row in rows)
        failed = (self.params.wrong, 0.0, (0.0,) * len(self.params.extra_columns))
        rows = [failed if row is None else row for row in rows]
        score = np.array([row[0] for row in rows], np.float32)
        acc = np.array([row[1] for row in rows], np.float32)
        extras = {name: np.array([row[2][j] for row in rows], np.float32)
                  for j, name in enumerate(self.params.extra_columns)}
        if masked.any():  # each masked row takes its group's mean: no advantage from it
            groups = batch.column(C.PROMPT_ID).to_numpy(zero_copy_only=False)
            fill = lambda values, empty: fill_from_group(groups, values, masked, empty).astype(np.float32)  # noqa: E731
            score, acc = fill(score, self.params.wrong), fill(acc, 0.0)
            extras = {name: fill(values, 0.0) for name, values in extras.items()}
        self._metrics = {"score/mean": float(score.mean()), "acc/mean": float(acc.mean()),
                         # a dict's extra values, averaged over the batch (verl logs its reward_extra_info so)
                         **{f"score/extra/{name}": float(values.mean()) for name, values in extras.items()},
                         **_per_source(batch, score, acc)}
        if self.params.timeout_s is not None:
            self._metrics["score/timeouts"] = Total(timed_out)
        if self.params.url is not None:
            self._metrics.update({"score/masked": Total(int(masked.sum())), "score/server_retries": Total(self._retries)})
        return with_columns(batch, {C.SCORE: score, C.ACC: acc, **extras})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        """Stop the worker processes (also done when the operator is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _remote(self, batch: pa.Table, texts: list[str], truths: list[str],
                extras: list[dict]) -> tuple[list[Row], np.ndarray]:
        """Rows scored by the reward server, and which are masked (``on_error: mask``: the
        server failed, or its function failed on the row; a placeholder Row each)."""
        settings = self.params.server or ServerSettings()
        if self._client is None:
            self._client = RewardClient(self.params.url, settings, self.ctx.node_id)
        prompts = batch.column(C.PROMPT_TEXT).to_pylist()
        wire = [{"prompt": p, "response": t, "ground_truth": g, "data_source": e.get("data_source")}
                for p, t, g, e in zip(prompts, texts, truths, extras)]
        before = self._client.retried
        entries = self._client.score(wire)
        self._retries = self._client.retried - before
        masked = np.array([entry is None or (settings.on_error == "mask" and isinstance(entry, dict)
                                             and "error" in entry) for entry in entries], bool)
        remote = RewardSpec("remote", extra_columns=self.params.extra_columns)  # acc: score > 0 unless given
        rows: list[Row] = []
        for entry, skip in zip(entries, masked):
            if skip:
                rows.append((0.0, 0.0, (0.0,) * len(self.params.extra_columns)))
            elif isinstance(entry, dict) and "error" in entry:
                rows.append(f"{entry['error']} (on the reward server)")
            else:
                rows.append(evaluate(lambda *_, value=entry: value, remote, "", ""))
        return rows, masked

    def _evaluate(self, batch: pa.Table, i: int, text: str, truth: str, extra: dict) -> Row:
        try:
            return evaluate(self.fn, self.spec, text, truth, extra)
        except BadReward as bad:
            raise RunError(self._bad(batch, i, str(bad))) from bad.__cause__

    def _pooled(self, batch: pa.Table, texts: list[str], truths: list[str], extras: list[dict]) -> list[Row]:
        if self._pool is None:
            self._pool = RewardPool(self.spec, self.params.workers, self.params.timeout_s)
        try:
            return self._pool.score(texts, truths, extras)
        except WorkerDied as died:
            where = (f"while scoring {_sample_name(batch, died.row)}" if died.row is not None
                     else "outside the function (starting up, or between rows)")
            raise RunError(
                f"reward function '{self.params.rule}' (node '{self.ctx.node_id}'): its worker "
                f"process died ({exit_text(died.exitcode)}) {where}, in a chunk of "
                f"{len(died.rows)} rows ({_sample_name(batch, died.rows[0])} to "
                f"{_sample_name(batch, died.rows[-1])})\n"
                "    a reward function must return, not end its process (os._exit, sys.exit, a "
                "crash in native code)\n"
                "    fix: find the sample's response and fix the function (or set timeout_s if it "
                "hangs); `dapo-flow run GRAPH --resume` then continues from the last checkpoint"
            ) from None
        except LoadFailed as failed:
            raise RunError(
                f"reward function '{self.params.rule}' (node '{self.ctx.node_id}') cannot be "
                f"loaded in a worker process: {failed}\n"
                "    fix: make it importable from a fresh Python process (workers are spawned: "
                "they see the package path and working directory, not the driver's runtime state)"
            ) from None

    def _bad(self, batch: pa.Table, row: int, what: str) -> str:
        """The error text for a bad reward: which function, node and sample, what it did."""
        sample = _sample_name(batch, row)
        response = _short(batch.column(C.RESPONSE_TEXT)[row].as_py())
        return (
            f"reward function '{self.params.rule}' (node '{self.ctx.node_id}') {what} for "
            f"{sample} (response {response})\n"
            "    a reward must be a finite number, or a dict with a finite number under 'score' "
            "(and optionally 'acc' and the declared extra_columns)\n"
            "    fix: make the function return one for every response (e.g. the wrong-answer "
            "score when it cannot parse the response); `dapo-flow run GRAPH --resume` then "
            "continues from the last checkpoint"
        )


def _sample_name(batch: pa.Table, row: int) -> str:
    parts = []
    if C.PROMPT_ID in batch.column_names:
        parts.append(f"prompt id {batch.column(C.PROMPT_ID)[row].as_py()!r}")
    if C.SAMPLE_IDX in batch.column_names:
        parts.append(f"sample {batch.column(C.SAMPLE_IDX)[row].as_py()}")
    return ", ".join(parts) or f"row {row}"


def _per_source(batch: pa.Table, score: np.ndarray, acc: np.ndarray) -> dict[str, float]:
    """``score/SOURCE/mean`` and ``acc/SOURCE/mean`` per ``data_source`` the rows carry (a
    mixture's sources apart, as verl reports its data sources)."""
    if C.DATA_SOURCE not in batch.column_names:
        return {}
    sources = batch.column(C.DATA_SOURCE).to_pylist()
    return {f"{what}/{name}/mean": total / count for what, values in (("score", score), ("acc", acc))
            for name, (total, count) in source_sums(sources, values).items()}


def _extra_infos(batch: pa.Table) -> list[dict]:
    """Each row's extra_info for the reward function: its ``data_source`` when the prompts
    carry one (verl-format data does; a verl-signature function receives it as an argument),
    its ``tool_reward`` after agent-generate and ``harness_reward`` after harness-generate."""
    keys = [c for c in (C.DATA_SOURCE, C.TOOL_REWARD, C.HARNESS_REWARD) if c in batch.column_names]
    columns = [batch.column(c).to_pylist() for c in keys]
    return [dict(zip(keys, values)) for values in zip(*columns)] if keys else [{} for _ in range(batch.num_rows)]
