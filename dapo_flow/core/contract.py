"""The operator contract: what every built-in or custom operator class provides.

An operator is a plain class (no base class to inherit from):

- ``Params``: a frozen Pydantic model (``extra="forbid"``), every field documented.
- ``REQUIRES`` / ``PRODUCES``: ``{column: arrow type}`` (see ``dapo_flow.core.columns``). An
  operator whose columns depend on its params defines ``requires(params)`` /
  ``produces(params)`` classmethods instead; :func:`requires` / :func:`produces` read either.
- optionally ``PRODUCES_WITH_TRAIN``: ``{train setting: {column: arrow type}}``, the columns the
  node adds besides those when its model's ``train.<setting>`` is on, settings of the model rather
  than of the node (``generate``: ``routed_experts`` under ``routing_replay``, the rollout's expert
  choices). :func:`produces` adds them given the model's ``train`` section, so validate's column
  checks and ``explain`` see them; a ``generate``-role op whose model has ``routing_replay`` on
  and that declares no ``routed_experts`` for it is refused at validate (the update would find
  no routes to replay).
- ``CARDINALITY``: ``map`` (one row out per row in), ``filter`` (drops whole rows; with
  ``group`` semantics it drops whole prompt groups), ``expand`` (several rows per row in,
  e.g. n samples per prompt), or ``sink`` (consumes the batch, returns a one-row metrics table).
- optionally ``resolve(params, available) -> params``: a classmethod the compiler calls with the
  ``{column: arrow type}`` reaching the node, before reading its columns, so a param can default
  to "whatever upstream provides" (e.g. advantage's ``reward_column: auto``). The resolved
  params are what explain shows, MLflow logs and the runtime runs.
- optionally ``SCOPE``: which rows each output row depends on, one of :data:`SCOPES`: `row` (its
  own row alone: a copied column, a per-response shaping), `group` (the rows of its prompt group
  alone: a group-normalized advantage) or `batch` (the default: any row of the call, e.g. an
  advantage whitened over the batch). An op whose params decide it has a ``scope(params)``
  classmethod instead (``advantage``: `group` for its per-sequence group estimators). The placement
  runs a stateless model-free `map` of `row` or `group` scope in the training group that consumes
  its output, on each worker's share of whole prompt groups, instead of one more round trip through
  the driver's stage (:func:`scope_of`).
- ``NEEDS_MODEL``: whether the node must name a model (``model:``) and runs in its actor.
  Optionally ``uses_model(params) -> bool``: a classmethod saying whether with these params the
  node touches its model (e.g. logprob's ``source: rollout`` copies a column, so it is placed in
  the driver instead of a round trip to the model's actor; `score` runs a reward model only with
  `reward: {model: NAME}`): the model is required exactly when it does. Optionally
  ``MODEL_PARAM``: the path of the param that names the node's model when its `model:` is left
  out (score's ``("reward", "model")``).
- ``ROLE``: what the operator is to the compiler and the runtime, one of :data:`ROLES` (default
  ``transform``). The compiler, checks and runtime read roles, never op names, so a custom
  operator declaring ``ROLE = "generate"`` is placed, weight-synced and validated with like the
  built-in ``generate``:

  - ``generate``: samples responses with its model. Placed in the rollout actor when placement is
    disaggregated, receives the weights after its model's ``train`` node, is what validation and
    ``eval`` sample with; its ``n`` param is the group size.
  - ``reward``: grades responses (produces ``score`` and ``acc``); what validation grades with.
  - ``logprob``: reads its model's token logprobs (the actor needs the torch model).
  - ``train``: trains its model (one per model): the model is trainable and checkpointed, and its
    new weights are synced to the model's generators after every step. Its instances hold the
    ``trainer`` whose optimizer a sharded checkpoint saves (:class:`TrainOperator`).
  - ``advantage``: turns rewards into advantages (a zero-spread group gives zero advantage).
  - ``transform``: anything else (shaping, filters, KL, metrics).
- optionally ``upstream_problems(params, generator_id, generator_params) -> [(field, message,
  fix)]``: a classmethod validate calls with the nearest ``generate``-role node upstream, for
  params that must agree with it (e.g. a logprob temperature equal to the sampling temperature).
- optionally ``model_problems(params, config) -> [(field, message, fix)]``: a classmethod
  validate calls with its model's config.json as a dict (a builtin's declared shape; only when
  one can be read without building or loading anything), for params the model must support
  (e.g. a load-balancing loss weight on a model without experts).
- optionally ``MODEL_HEAD``: what its model must be, `lm` (a causal LM, the default), `value`
  (a critic: ``values``, ``critic-update``) or `reward` (a sequence classifier: ``score``);
  validate checks it against the model's ``head``. An op whose params decide it also has a
  ``model_head(params)`` classmethod (``score``: `lm` with ``output: likelihood``).
- optionally ``combine(params, tables) -> pa.Table`` and ``input_requires(params) -> (dict, ...)``
  (classmethods): a node that joins its several inputs itself (e.g. ``baseline`` joins a
  per-prompt table onto the samples by prompt id), instead of the default row-by-row merge of
  inputs that share their rows; each input must bring its ``input_requires`` columns, and the
  rows going on are the first input's.
- optionally ``explain_notes(params) -> [str]`` (a classmethod): lines `explain` prints under the
  node (harness-generate: where its endpoint will serve).
- what the compiler sizes and checks a role's node by, read from its params through a classmethod
  the op declares, never by the param's name: a ``generate`` op's ``sampling_settings(params) ->
  Sampling`` (its group size and longest response), a ``train`` op's ``train_sizing(params) ->
  TrainSizing`` (mini-batches, rows per forward, an entropy term), and any other op's that runs
  a model it does not train (logprob, values, a reward model) ``forward_rows(params) -> int |
  None``. An op that declares none is read by the built-in ops' param names (``n``,
  ``max_tokens``; ``mini_batches``, ``micro_batch_size``, ``entropy_coef``; ``micro_batch_size``,
  a reward model's under ``reward``), those it lacks taking the defaults: :func:`sampling_of`,
  :func:`train_sizing_of`, :func:`forward_rows_of`. A ``group-filter`` op's ``group_settings(params)
  -> GroupSettings`` is what dynamic sampling reads (:func:`group_settings_of`). A ``logprob`` op's
  ``logprob_role(params) -> str`` says whose logprobs it reads (:data:`LOGPROB_ROLES`: a frozen
  reference's or teacher's must not be trained), else its ``role`` param, else ``actor``
  (:func:`logprob_role_of`). A generate op's :class:`Sampling` also names the tool-call format
  its model writes (``call_format``, what `serve` parses), else its ``format`` param, else ``hermes``.
- ``__init__(params, ctx)``, ``__call__(batch: pa.Table) -> pa.Table``, and optionally
  ``last_metrics() -> dict[str, float]`` for what the last call measured (a plain float is
  averaged over a step's calls; a count, a time, a throughput or an extreme says so by its
  value's type: ``dapo_flow.reductions``), ``state_dict()`` /
  ``load_state_dict(state)`` for what a checkpoint keeps, ``close()`` for what to release.

The compiler and the runtime read all of this through one frozen object per class,
:func:`contract_of` -> :class:`Contract` (the defaults filled in, each optional hook a callable
or None), never by probing the class or its instances themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

Cardinality = Literal["map", "filter", "group-filter", "expand", "sink"]
CARDINALITIES: tuple[str, ...] = ("map", "filter", "group-filter", "expand", "sink")

#: Which rows an operator's output row depends on (see the module docstring: ``SCOPE``).
SCOPES: tuple[str, ...] = ("row", "group", "batch")
DEFAULT_SCOPE = "batch"

#: What an operator is to the compiler and runtime (see the module docstring).
ROLES: tuple[str, ...] = ("generate", "reward", "logprob", "train", "advantage", "transform")
DEFAULT_ROLE = "transform"


def registered(value: str, registry: Mapping[str, Any]) -> str:
    """``value`` if it is a key of ``registry`` (a backend, an estimator, ...), else the error a
    Literal field gives, so `validate` words it alike and suggests the closest name. For fields
    whose choices can grow at run time (a plugin adds to the registry), where a Literal cannot."""
    if value not in registry:
        from pydantic_core import PydanticCustomError

        expected = " or ".join(f"'{name}'" for name in registry)
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return value


@dataclass(frozen=True)
class Contract:
    """Everything the compiler and the runtime read of an operator class, read from it in one
    place (:func:`contract_of`): its declarations, with the defaults of what it leaves out, and
    its optional hooks as callables or None. Nothing else probes an operator for attributes
    (:func:`contract_problems` checks the raw declarations of a custom one first)."""

    cardinality: str | None
    needs_model: bool
    role: str
    requires_fn: Callable[[BaseModel], Mapping[str, pa.DataType]] | None
    requires_static: Mapping[str, pa.DataType]
    produces_fn: Callable[[BaseModel], Mapping[str, pa.DataType]] | None
    produces_static: Mapping[str, pa.DataType]
    resolve: Callable[[BaseModel, dict], BaseModel] | None
    upstream_problems: Callable[..., Any] | None
    model_problems: Callable[..., Any] | None
    uses_model: Callable[[BaseModel], bool] | None
    model_head_fn: Callable[[BaseModel], str] | None
    model_head_static: str
    model_param: tuple[str, ...]
    combine: Callable[[BaseModel, list], pa.Table] | None  # joins its inputs itself (baseline)
    input_requires: Callable[[BaseModel], tuple] | None
    inputs_hint: str  # what its inputs are, for a wrong count (``INPUTS``, baseline's "[samples, per_prompt]")
    stateful: bool  # instances checkpoint: state_dict() / load_state_dict(state)
    reports_metrics: bool  # instances have last_metrics()
    closes: bool  # instances hold something to release: close()
    explain_notes: Callable[[BaseModel], list[str]] | None = None  # extra lines `explain` prints under the node
    sampling_settings: Callable[[BaseModel], "Sampling"] | None = None  # a generate op's group size, longest response
    train_sizing: Callable[[BaseModel], "TrainSizing"] | None = None  # a train op's update, as memory is sized
    forward_rows: Callable[[BaseModel], int | None] | None = None  # rows per forward of a model it only reads
    group_settings: Callable[[BaseModel], "GroupSettings"] | None = None  # a group filter's, for dynamic sampling
    # train setting -> columns added when the node's model has it on (PRODUCES_WITH_TRAIN)
    produces_with_train: Mapping[str, Mapping[str, pa.DataType]] = field(default_factory=dict)
    logprob_role: Callable[[BaseModel], str] | None = None  # a logprob op's: whose logprobs (LOGPROB_ROLES)
    scope_fn: Callable[[BaseModel], str] | None = None  # which rows an output row depends on (SCOPES)
    scope_static: str = DEFAULT_SCOPE


def contract_of(op_cls: type) -> Contract:
    """The :class:`Contract` of an operator class (the module docstring says what each part is)."""
    hook = lambda name: fn if callable(fn := getattr(op_cls, name, None)) else None  # noqa: E731
    return Contract(
        cardinality=getattr(op_cls, "CARDINALITY", None),
        needs_model=getattr(op_cls, "NEEDS_MODEL", False) is True,
        role=getattr(op_cls, "ROLE", DEFAULT_ROLE),
        requires_fn=hook("requires"),
        requires_static=dict(getattr(op_cls, "REQUIRES", None) or {}),
        produces_fn=hook("produces"),
        produces_static=dict(getattr(op_cls, "PRODUCES", None) or {}),
        resolve=hook("resolve"),
        upstream_problems=hook("upstream_problems"),
        model_problems=hook("model_problems"),
        uses_model=hook("uses_model"),
        model_head_fn=hook("model_head"),
        model_head_static=getattr(op_cls, "MODEL_HEAD", "lm"),
        model_param=tuple(getattr(op_cls, "MODEL_PARAM", None) or ()),
        combine=hook("combine"),
        input_requires=hook("input_requires"),
        inputs_hint=str(getattr(op_cls, "INPUTS", "")),
        stateful=callable(getattr(op_cls, "state_dict", None)),
        reports_metrics=callable(getattr(op_cls, "last_metrics", None)),
        closes=callable(getattr(op_cls, "close", None)),
        explain_notes=hook("explain_notes"),
        sampling_settings=hook("sampling_settings"),
        train_sizing=hook("train_sizing"),
        forward_rows=hook("forward_rows"),
        group_settings=hook("group_settings"),
        produces_with_train={k: dict(v) for k, v in dict(getattr(op_cls, "PRODUCES_WITH_TRAIN", None) or {}).items()},
        logprob_role=hook("logprob_role"),
        scope_fn=hook("scope"),
        scope_static=getattr(op_cls, "SCOPE", DEFAULT_SCOPE),
    )


@dataclass(frozen=True)
class Sampling:
    """What the compiler reads of a ``generate``-role node's params: ``n``, the samples per prompt
    (its group size), and ``max_tokens``, the longest response (None: the node sets no bound)."""

    n: int = 1
    max_tokens: int | None = None
    greedy: bool = False  # temperature 0 or top_k 1: the n samples of a prompt are one response
    call_format: str = "hermes"  # how its model writes tool calls (tools.calls.CALL_FORMATS): what `serve` parses


@dataclass(frozen=True)
class TrainSizing:
    """What the compiler reads of a ``train``-role node's params to size its update's memory: its
    optimizer steps per RL step (``mini_batches``), its rows per forward (``micro_batch_size``;
    None: one worker's share of a mini-batch) and whether its loss has an entropy term (which
    widens the logits' backward)."""

    mini_batches: int = 1
    micro_batch_size: int | None = None
    entropy_in_loss: bool = False


def sampling_of(op_cls: type, params: BaseModel) -> Sampling:
    """A generate node's :class:`Sampling`: its op's ``sampling_settings(params)``, else read by the
    built-in generate's param names (a custom op written before the hook)."""
    fn = contract_of(op_cls).sampling_settings
    if fn is not None:
        return fn(params)
    return Sampling(n=getattr(params, "n", 1), max_tokens=getattr(params, "max_tokens", None),
                    greedy=getattr(params, "temperature", None) == 0 or getattr(params, "top_k", None) == 1,
                    call_format=getattr(params, "format", "hermes"))


@dataclass(frozen=True)
class GroupSettings:
    """What dynamic sampling reads of a group filter's params (the op's ``group_settings(params)``;
    without one, the built-in group-filter's param names, each one lacking at its default)."""

    metric: str = "acc"  # the per-sequence value whose spread keeps a group (for messages)
    max_gen_batches: int = 0  # generation batches per step before on_cap applies; 0: no cap
    on_cap: str = "error"  # "error" | "train-on-what-we-have" | "skip-step"
    max_skipped_steps: int = 0  # steps in a row that train nothing before the run stops; 0: never


def group_settings_of(op_cls: type, params: BaseModel) -> GroupSettings:
    """A group filter's :class:`GroupSettings`: its op's ``group_settings(params)``, else read by
    the built-in group-filter's param names."""
    fn = contract_of(op_cls).group_settings
    if fn is not None:
        return fn(params)
    return GroupSettings(**{f: getattr(params, f) for f in ("metric", "max_gen_batches", "on_cap", "max_skipped_steps")
                            if hasattr(params, f)})


def forward_rows_of(op_cls: type, params: BaseModel) -> int | None:
    """Rows per forward of a node that runs a model without training it: its op's
    ``forward_rows(params)``, else its ``micro_batch_size`` param (a reward model's under
    ``reward``); None: the model's default."""
    fn = contract_of(op_cls).forward_rows
    if fn is not None:
        return fn(params)
    for holder in (params, getattr(params, "reward", None)):
        rows = getattr(holder, "micro_batch_size", None)
        if isinstance(rows, int):
            return rows
    return None


#: whose logprobs a ``logprob``-role node reads: the trained policy's (``actor``: the old logprobs),
#: a frozen reference model's (``ref``: the KL term's) or a frozen teacher's (``teacher``: distillation's)
LOGPROB_ROLES: tuple[str, ...] = ("actor", "ref", "teacher")
LOGPROB_ROLE_PARAM = "role"  # the built-in logprob's param that says it, read when an op declares no hook


def logprob_role_of(op_cls: type, params: BaseModel) -> str:
    """Whose logprobs a logprob node reads (:data:`LOGPROB_ROLES`): its op's ``logprob_role(params)``,
    else the built-in logprob's ``role`` param by name, else ``actor`` (a custom op written before the
    hook, or one such as ``values`` that reads a model it trains)."""
    fn = contract_of(op_cls).logprob_role
    if fn is not None:
        return fn(params)
    return getattr(params, LOGPROB_ROLE_PARAM, "actor")


def train_sizing_of(op_cls: type, params: BaseModel) -> TrainSizing:
    """A train node's :class:`TrainSizing`: its op's ``train_sizing(params)``, else read by the
    built-in update's param names (a custom op written before the hook)."""
    fn = contract_of(op_cls).train_sizing
    if fn is not None:
        return fn(params)
    return TrainSizing(mini_batches=getattr(params, "mini_batches", 1),
                       micro_batch_size=getattr(params, "micro_batch_size", None),
                       entropy_in_loss=getattr(params, "entropy_coef", 0.0) > 0)


def role(op_cls: Any) -> str:
    """The operator class's declared role, ``transform`` when it declares none."""
    return contract_of(op_cls).role


def upstream_problems(op_cls: type, params: BaseModel, generator_id: str,
                      generator_params: BaseModel) -> list[tuple[str, str, str]]:
    """(field, message, fix) for each param of ``params`` that disagrees with the params of
    generator node ``generator_id``."""
    fn = contract_of(op_cls).upstream_problems
    return list(fn(params, generator_id, generator_params)) if fn else []


#: The config of every built-in operator's ``Params``: frozen (a plan never changes under a
#: running graph), no unknown keys (a typo is an error), and each field's docstring as its
#: description (what `dapo-flow ops` prints). Custom operators may use it too.
PARAMS_CONFIG = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

@dataclass
class OpContext:
    """What an operator instance may use at run time, handed in by the runtime.

    ``model`` is the loaded model resource of the node's ``model:`` (None for CPU ops);
    ``models`` maps every model name the worker hosts to its resource. In a training group
    (``world_size`` > 1) the operator runs on each of the group's ``world_size`` workers, each
    with its share of the rows (whole prompt groups); ``rank`` says which worker this is.
``workdir``: the driver's working directory when the run started, where a relative file an
operator names (a reward function's) resolves, in whichever process the operator runs.
    """

    node_id: str
    seed: int = 0
    model: Any = None
    models: Mapping[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    workdir: str | None = None  # the driver's working directory at start: where user files resolve


class HoldsOptimizer(Protocol):
    """What a checkpoint reads of a train op's trainer (:class:`dapo_flow.training.trainer.Trainer`
    has it): its torch optimizer, whose state is saved beside a sharded model's weight shards."""

    optimizer: Any


class TrainOperator(Protocol):
    """An instance of a ``train``-role operator: besides ``__call__``, the ``trainer`` that
    updates its model, which the runtime reads to checkpoint a sharded model's optimizer state
    with its weights (``update`` and ``critic-update`` build theirs with
    :func:`dapo_flow.training.trainer.make_trainer`)."""

    trainer: HoldsOptimizer

    def __call__(self, batch: pa.Table) -> pa.Table: ...


def resolve(op_cls: type, params: BaseModel, available: Mapping[str, pa.DataType]) -> BaseModel:
    """``params`` with the op's upstream-dependent values filled in (unchanged without a hook)."""
    fn = contract_of(op_cls).resolve
    return fn(params, dict(available)) if fn else params


def scope_of(op_cls: type, params: BaseModel) -> str:
    """Which rows each output row of the node depends on (:data:`SCOPES`): ``scope(params)``, else
    ``SCOPE``, else `batch` (nothing may be split off an operator that does not say)."""
    c = contract_of(op_cls)
    return c.scope_fn(params) if c.scope_fn is not None else c.scope_static


def uses_model(op_cls: type, params: BaseModel) -> bool:
    """Whether a node of ``op_cls`` with ``params`` runs on its model (``NEEDS_MODEL``, unless
    the op's ``uses_model(params)`` hook says these params need none)."""
    c = contract_of(op_cls)
    if not c.needs_model:
        return False
    return bool(c.uses_model(params)) if c.uses_model else True


def model_head(op_cls: type, params: BaseModel | None) -> str:
    """What the model of a node of ``op_cls`` must be (`lm`, `value` or `reward`): its
    ``model_head(params)`` hook when it has one and ``params`` validated, else ``MODEL_HEAD``."""
    c = contract_of(op_cls)
    if c.model_head_fn and params is not None:
        return c.model_head_fn(params)
    return c.model_head_static


def node_model(op_cls: type | None, model: str | None, params: BaseModel | None) -> str | None:
    """The model a node runs on: its `model:`, else the one its params name at the op's
    ``MODEL_PARAM`` path (`score` with `reward: {model: rm}`), else None."""
    if model is not None or op_cls is None or params is None:
        return model
    value: object = params
    for key in contract_of(op_cls).model_param:
        value = getattr(value, key, None)  # a path through the params, not a hook
    return value if isinstance(value, str) else None


def requires(op_cls: type, params: BaseModel) -> dict[str, pa.DataType]:
    """Input columns of ``op_cls`` configured with ``params``."""
    c = contract_of(op_cls)
    return dict(c.requires_fn(params)) if c.requires_fn else dict(c.requires_static)


def produces(op_cls: type, params: BaseModel, train: Any = None) -> dict[str, pa.DataType]:
    """Output columns ``op_cls`` adds (map/expand) or emits (sink) with ``params``; with ``train``
    (the ``train`` section of the node's model, a ``graph.spec.TrainSpec``) also those its
    ``PRODUCES_WITH_TRAIN`` declares for the settings that are on there."""
    c = contract_of(op_cls)
    made = dict(c.produces_fn(params)) if c.produces_fn else dict(c.produces_static)
    for setting, columns in c.produces_with_train.items():
        if train is not None and getattr(train, setting, False):  # a model setting, not a node param
            made.update(columns)
    return made


def contract_problems(op_cls: Any) -> list[str]:
    """Everything wrong with a class as an operator; [] when it satisfies the contract."""
    problems: list[str] = []
    params = getattr(op_cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        problems.append("needs a nested `Params` class that is a pydantic BaseModel")
    else:
        cfg = params.model_config
        if cfg.get("extra") != "forbid" or not cfg.get("frozen"):
            problems.append(
                "`Params` must set model_config = ConfigDict(frozen=True, extra='forbid')"
            )
    if getattr(op_cls, "CARDINALITY", None) not in CARDINALITIES:
        problems.append(f"`CARDINALITY` must be one of {', '.join(CARDINALITIES)}")
    for name in ("REQUIRES", "PRODUCES"):
        method = name.lower()
        value = getattr(op_cls, name, None)
        if value is None and not callable(getattr(op_cls, method, None)):
            problems.append(f"needs `{name}` (column -> arrow type) or a `{method}(params)`")
        elif value is not None and not all(
            isinstance(k, str) and isinstance(v, pa.DataType) for k, v in dict(value).items()
        ):
            problems.append(f"`{name}` must map column names to pyarrow DataTypes")
    with_train = getattr(op_cls, "PRODUCES_WITH_TRAIN", None)
    if with_train is not None and not (isinstance(with_train, Mapping) and all(
            isinstance(setting, str) and isinstance(cols, Mapping)
            and all(isinstance(k, str) and isinstance(v, pa.DataType) for k, v in cols.items())
            for setting, cols in with_train.items())):
        problems.append("`PRODUCES_WITH_TRAIN` must map train settings to {column: pyarrow DataType}")
    if not isinstance(getattr(op_cls, "NEEDS_MODEL", None), bool):
        problems.append("needs `NEEDS_MODEL = True/False`")
    if not callable(getattr(op_cls, "scope", None)) and getattr(op_cls, "SCOPE", DEFAULT_SCOPE) not in SCOPES:
        problems.append(f"`SCOPE` must be one of {', '.join(SCOPES)} (or left out: {DEFAULT_SCOPE})")
    declared_role = getattr(op_cls, "ROLE", DEFAULT_ROLE)
    if declared_role not in ROLES:
        problems.append(f"`ROLE` must be one of {', '.join(ROLES)} (or left out: {DEFAULT_ROLE})")
    elif declared_role in ("generate", "logprob", "train") and getattr(op_cls, "NEEDS_MODEL", None) is False:
        problems.append(f"`ROLE = {declared_role!r}` works on a model: set `NEEDS_MODEL = True`")
    elif isinstance(params, type) and issubclass(params, BaseModel):
        problems += _undeclared_settings(op_cls, declared_role, params)
    if not callable(getattr(op_cls, "__call__", None)):
        problems.append("needs `__call__(self, batch: pa.Table) -> pa.Table`")
    return problems


#: per role, the hook declaring what the compiler reads of its params, and the built-in ops'
#: param names it reads them by when an op declares no hook
ROLE_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "generate": ("sampling_settings", ("n", "max_tokens", "temperature", "top_k")),
    "train": ("train_sizing", ("mini_batches", "micro_batch_size", "entropy_coef")),
}


def _undeclared_settings(op_cls: Any, declared_role: str, params: type[BaseModel]) -> list[str]:
    """A role's op that neither declares its settings' hook nor has a param of the built-in
    names: the compiler would size it by defaults without a word."""
    hook, names = ROLE_SETTINGS.get(declared_role, ("", ()))
    if not hook or callable(getattr(op_cls, hook, None)) or any(n in params.model_fields for n in names):
        return []
    return [f"`ROLE = {declared_role!r}` without a `{hook}(params)` classmethod, and `Params` has none of "
            f"{', '.join(names)}: the compiler could not size its node (see dapo_flow.core.contract)"]
