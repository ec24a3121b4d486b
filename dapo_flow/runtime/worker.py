"""StageWorker: hosts the operator nodes of one stage (an actor, or the driver).

The same class runs in-process (local executor) and as a long-lived Ray actor (created
once per run, never per step). Nodes arrive as plain data (id, op, impl, params, model)
and are resolved here, so custom operators loaded from files work inside actors too.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import pyarrow as pa

from dapo_flow import threads
from dapo_flow.errors import RunError
from dapo_flow.runtime import group as group_rows
from dapo_flow.runtime.metrics import batch_stats, first_row
from dapo_flow.runtime.tables import ChainInfo, assemble, info_of, merge_inputs
from dapo_flow.core.contract import Contract, OpContext, TrainOperator, contract_of
from dapo_flow.graph.plan import GROUP_STRATEGIES
from dapo_flow.graph.spec import GraphSpec
from dapo_flow.models.engines import Backend
from dapo_flow.models.lora import is_adapter_dir
from dapo_flow.runtime.checkpoint_models import (SHARDED, checkpoint_format, load_sharded_model,
                                                 save_sharded_model)


#: Methods an executor runs beside the worker's other calls (run.partial_rollouts: a weight load
#: while a generate call is in flight; the engine's WeightGate keeps them apart token by token).
#: Every other call of a worker runs after the one before it, as an actor takes them.
LIVE_METHODS = frozenset({"import_weights_live", "receive_weights_live"})
#: a rollout replica keeps its operators' states from before its last this many calls: a lost
#: replica's share of one of them is run again by a survivor soon after (one step's calls)
KEPT_CALL_STATES = 64


@dataclass(frozen=True)
class NodeSetup:
    """What a worker needs to build one node; picklable across processes."""

    id: str
    op: str
    params: Mapping[str, Any]
    impl: str  # where its class is: `module:Class`, or a custom op's `file.py:Class`
    model: str | None = None
    base_dir: str = "."  # what a relative `file.py` resolves against


@dataclass(frozen=True)
class StageSetup:
    name: str
    nodes: tuple[NodeSetup, ...]
    models: tuple[str, ...]
    trainable: tuple[str, ...] = ()  # models some node of this stage updates
    generates: tuple[str, ...] = ()  # models some node of this stage generates with
    scores: tuple[str, ...] = ()  # models used by logprob/update nodes here
    engine_scored: tuple[str, ...] = ()  # of those, frozen ones scored by their engine (Plan.engine_scored)
    model_paths: Mapping[str, str] = field(default_factory=dict)  # overrides (resume)
    weights_version: int = 0  # the policy version of the model_paths' weights (resume: the checkpoint's)
    max_model_len: Mapping[str, int] = field(default_factory=dict)  # engines' default context (setup)
    backends: Mapping[str, Backend] = field(default_factory=dict)  # model -> the backend it was compiled with
    num_threads: int = 0  # threads.configure(num_threads) in the worker; 0 = the process's as they are
    strategy: str = "none"  # the group's: "fsdp2" (each worker a shard) | "ddp" (each a full copy)
    workers: int = 1  # the group's size
    placement_strategy: str = "PACK"  # the group's placement group strategy
    workdir: str | None = None  # the driver's working directory at start (OpContext.workdir)
    group: "GroupMember | None" = None  # set by the executor for each worker of a group

    @property
    def grouped(self) -> bool:
        """A training group's stage: FSDP2 or DDP workers (the executor starts them)."""
        return self.strategy in GROUP_STRATEGIES


@dataclass(frozen=True)
class GroupMember:
    """Which worker of a training group (an FSDP2 process group) a StageWorker is."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class Share:
    """Which rows of a call's input one member of a group takes: a training group's update
    gets prompt groups dealt out with their batch positions (``for_update``), every other call
    a contiguous run (dapo_flow.runtime.group). Each member cuts its own share from the whole
    input, so the input never passes through the driver to be split."""

    rank: int
    members: int
    for_update: bool = False

    def of(self, table: pa.Table, sequence_parallel: int = 1) -> pa.Table:
        """``sequence_parallel`` k: the update's rows are dealt to the group's members / k
        replicas, consecutive ranks one replica, whose k workers each run a slice of every one of
        its sequences (other calls run whole rows on every member, as without)."""
        if self.for_update:
            k = sequence_parallel
            return group_rows.update_share(table, self.members // k, self.rank // k)
        return group_rows.share(table, self.members, self.rank)


def quiet_libraries() -> None:
    """transformers' per-load progress bars and info logs drown the run's own progress;
    so do vLLM's (read at its import, so this runs first in every worker). A library imported
    after this reads the variables; one already imported is told. Nothing is imported here: a
    worker without a model (the driver stage's actor) never loads transformers (~0.7 s of CPU)."""
    import os
    import sys

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # ERROR, not WARNING: every weight sync warns "RotaryEmbedding: Failed to load weights"
    # (its cos/sin cache is not a weight, so it keeps its own: harmless)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:  # read its variable when it was imported
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def resolve_op(node: NodeSetup) -> type:
    """The node's operator class, imported in this process from where the compiler found it (a
    plugin's too: no registry needs loading in an actor)."""
    from dapo_flow.core.imports import load_object

    return load_object(node.impl, base_dir=Path(node.base_dir))


class StageWorker:
    """Loads the stage's models once, builds its operators, runs them on Arrow tables."""

    def __init__(self, graph: GraphSpec, setup: StageSetup, seed: int,
                 fetch: Callable[[list], list[pa.Table]] | None = None):
        """``fetch``: how the parts of a table handle become tables (in-process they are the
        tables; a Ray actor's worker fetches references from the object store)."""
        self.fetch = fetch or _as_they_are
        quiet_libraries()
        if setup.num_threads:
            threads.configure(setup.num_threads)
        if setup.models:
            import torch

            torch.manual_seed(seed)
        from dapo_flow.runtime.resources import load_resource, model_device

        self.setup = setup
        group = setup.group
        if group is not None:  # every worker of the group joins before any model is sharded / replicated
            from dapo_flow.models import fsdp

            trained = (setup.trainable or setup.models)[0]  # the model the group trains: its device's backend
            fsdp.init_group(group.rank, group.world_size, group.master_addr, group.master_port,
                            device=model_device(graph.models[trained]))
        self.resources = {
            name: load_resource(
                name, graph.models[name], path=setup.model_paths.get(name),
                trainable=name in setup.trainable, generates=name in setup.generates,
                scores=name in setup.scores, engine_scored=name in setup.engine_scored, seed=seed,
                max_model_len=setup.max_model_len.get(name),
                strategy=setup.strategy if group is not None else "none", backend=setup.backends.get(name),
            )
            for name in setup.models
        }
        for name in setup.model_paths:  # resumed weights: each sampled token reports their version
            if name in self.resources:
                self.resources[name].set_weights_version(setup.weights_version)
        # the trained model's train.sequence_parallel: how many workers share each row of an update
        self._sequence_parallel = (graph.models[setup.trainable[0]].train.sequence_parallel
                                   if group is not None and setup.trainable else 1)
        self.ops: dict[str, Any] = {}
        self.op_classes: dict[str, type] = {}
        self.contracts: dict[str, Contract] = {}  # each node's operator contract, read once
        self.model_of: dict[str, str | None] = {}
        self.buses: dict[str, Any] = {}  # model -> its WeightBus (broadcast weight sync)
        self.states_before: dict[int, dict] = {}  # a replica's recent row calls -> op_states() before each
        for node in setup.nodes:
            cls = resolve_op(node)
            params = cls.Params.model_validate(dict(node.params))
            ctx = OpContext(
                node_id=node.id, seed=seed, model=self.resources.get(node.model or ""),
                models=self.resources, rank=group.rank if group else 0,
                world_size=group.world_size if group else 1, workdir=setup.workdir,
            )
            self.op_classes[node.id] = cls
            self.contracts[node.id] = contract_of(cls)
            self.model_of[node.id] = node.model
            self.ops[node.id] = cls(params, ctx)
        for name, path in setup.model_paths.items():  # resume: sharded states need the optimizers
            frozen_lora = name not in setup.trainable and is_adapter_dir(Path(path))  # merged at load
            if name in self.resources and checkpoint_format(Path(path)) == SHARDED and not frozen_lora:
                self._load_sharded(name, Path(path))

    def ready(self) -> bool:
        return True

    def run(self, node_id: str, table: pa.Table) -> tuple[pa.Table, dict[str, float], float]:
        """Run one node; returns (output table, the node's metrics, seconds). A sink (e.g. the
        update) reports its output, one row of metrics, and ``batch/*`` statistics of the batch
        it consumed (the trained batch, wherever the plan runs it): the driver reads a step's
        metrics from the calls' reports alone, and no table comes back for them."""
        start = time.perf_counter()
        op = self.ops[node_id]
        out = op(table)
        self._rest_engine(node_id)
        seconds = time.perf_counter() - start
        contract = self.contracts[node_id]
        metrics = op.last_metrics() if contract.reports_metrics else {}
        if contract.cardinality == "sink":
            metrics = {**batch_stats(table), **metrics, **first_row(out)}
        return out, metrics, seconds

    def run_chain(self, node_ids: list[str], inputs: Any, share: "Share | None" = None,
                  number: int | None = None) -> tuple[pa.Table, ChainInfo]:
        """Run a linear chain of this stage's nodes in one call (one round trip); returns the
        last output and a :class:`ChainInfo` (each node's metrics and seconds, row counts, the
        output's prompt groups). ``inputs``: the first node's input tables, one per input, as
        handles (tables, references, TableParts; one handle alone is the only input); a group
        worker takes its ``share`` of the joined input. ``number``: the call's number among a
        rollout replica group's (which heals in place): the operators' states before it are
        kept a while, for :meth:`redo_chain`."""
        if number is not None:
            self.states_before[number] = copy.deepcopy(self.op_states())
            for old in [n for n in self.states_before if n <= number - KEPT_CALL_STATES]:
                del self.states_before[old]
        table = self._input(node_ids[0], inputs, share)
        rows_in = table.num_rows
        report = []
        for nid in node_ids:
            table, metrics, seconds = self.run(nid, table)
            report.append((nid, metrics, seconds))
        return table, info_of(report, rows_in, table)

    def redo_chain(self, node_ids: list[str], inputs: Any, share: "Share", number: int
                   ) -> tuple[pa.Table, ChainInfo]:
        """:meth:`run_chain` call ``number`` again for a lost replica's ``share`` of it, this
        worker's operators as they were before that call (generate's seeds are per prompt and
        call: the lost replica's samples), then as they are now again."""
        if number not in self.states_before:
            raise RunError(f"call {number} of this replica is too old to run again (the states of its last "
                           f"{KEPT_CALL_STATES} calls are kept)")
        now = copy.deepcopy(self.op_states())
        self.load_op_states(self.states_before[number])
        try:
            return self.run_chain(node_ids, inputs, share)
        finally:
            self.load_op_states(now)

    def run_variant(self, node_id: str, inputs: Any, overrides: Mapping[str, Any],
                    share: "Share | None" = None) -> pa.Table:
        """Run a node with some params replaced (validation: greedy, n=1), statelessly."""
        op = self.ops[node_id]
        variant = self.op_classes[node_id](op.params.model_copy(update=dict(overrides)), op.ctx)
        # no rest here: validation's (and eval's) generate calls follow one another
        return variant(self._input(node_id, inputs, share))

    def _rest_engine(self, node_id: str) -> None:
        """After a training step's generate node, let its model's engine free the device for the
        trainer beside it (colocated vLLM with sleep mode); it wakes for the next weight sync or
        generate."""
        if self.contracts[node_id].role == "generate":
            resource = self.resources.get(self.model_of[node_id] or "")
            if resource is not None:
                resource.rest_generator()

    def _input(self, node_id: str, inputs: Any, share: "Share | None") -> pa.Table:
        handles = inputs if isinstance(inputs, list) else [inputs]
        tables = [assemble(h, self.resolve) for h in handles]
        table = merge_inputs(self.contracts[node_id].combine, self.ops[node_id].params, tables)
        return share.of(table, self._sequence_parallel) if share is not None else table

    def resolve(self, parts: list) -> list[pa.Table]:
        """Tables from handles' parts (``fetch``)."""
        return self.fetch(parts)

    # --- weights ------------------------------------------------------------
    def sync_generators(self) -> float:
        """Colocated: push each trained policy into its own rollout engine (the plan asks only
        where the backend's engine is not the policy itself, e.g. vllm)."""
        return sum(self.resources[m].sync_generator() for m in self.setup.trainable)

    def export_weights(self, model: str) -> dict:
        return self.resources[model].policy.named_weights()

    def attention(self, model: str) -> str:
        """The attention implementation ``model``'s loaded copy runs under (``ulysses_sdpa`` once
        train.sequence_parallel split it): what a group really runs, for a check."""
        return self.resources[model].policy.model.config._attn_implementation

    def import_weights(self, model: str, weights: dict, version: int | None = None) -> float:
        """``model``'s weights (of policy ``version``) from the object store; seconds taken."""
        return self.resources[model].load_weights(weights, version)

    def import_weights_live(self, model: str, weights: dict, version: int) -> float:
        """:meth:`import_weights` beside a generate call in flight (:data:`LIVE_METHODS`)."""
        return self.import_weights(model, weights, version)

    # --- broadcast weight sync (rollout.weight_sync: broadcast; models.weight_bus) -------------
    def weight_bus_address(self) -> tuple[str, int]:
        """This worker's node address and a port free there: the bus's rank 0 (the trainer)."""
        from dapo_flow.runtime.node import node_address

        return node_address()

    def join_weight_bus(self, model: str, addr: str, port: int, rank: int, world_size: int, backend: str) -> bool:
        """Join ``model``'s weight bus as ``rank`` (a rendezvous: every member at once). In a
        training group only rank 0 joins (it sends); the others just gather with it."""
        from dapo_flow.models.weight_bus import WeightBus

        if self.setup.group is not None and self.setup.group.rank != 0:
            return False
        old = self.buses.pop(model, None)
        if old is not None:  # formed again: a member was lost or joined
            old.close()
        self.buses[model] = WeightBus(addr, port, rank, world_size, backend)
        return True

    def weight_manifest(self, model: str) -> list:
        return self.resources[model].policy.weight_manifest()

    def send_weights(self, model: str, manifest: list, bucket_bytes: int) -> float:
        """Broadcast ``model``'s weights (``manifest``: :meth:`weight_manifest`'s, fetched once) on
        its bus; seconds taken. A training group's other workers iterate alongside (gathering a
        sharded weight is a collective of the group)."""
        start = time.perf_counter()
        policy = self.resources[model].policy
        bus = self.buses.get(model)
        if bus is None:
            for _ in policy.iter_weights():
                pass
        else:
            bus.send(policy.iter_weights(), manifest, bucket_bytes)
        return time.perf_counter() - start

    def receive_weights(self, model: str, manifest: list, bucket_bytes: int, version: int | None = None) -> float:
        """Take ``model``'s weights (of policy ``version``) from its bus into this actor's engine
        (or torch copy), a bucket at a time; seconds taken."""
        return self.resources[model].load_weights(self.buses[model].receive(manifest, bucket_bytes), version)

    def receive_weights_live(self, model: str, manifest: list, bucket_bytes: int, version: int) -> float:
        """:meth:`receive_weights` beside a generate call in flight (:data:`LIVE_METHODS`)."""
        return self.receive_weights(model, manifest, bucket_bytes, version)

    def close(self) -> None:
        """Release what operators hold (a reward pool's processes), rollout engines that are not
        the torch policy itself, and leave the group."""
        for nid, op in self.ops.items():
            if self.contracts[nid].closes:
                op.close()
        for res in self.resources.values():
            res.close()
        for bus in self.buses.values():
            bus.close()
        if self.setup.group is not None:
            from dapo_flow.models import fsdp

            fsdp.destroy_group()

    # --- checkpoints ----------------------------------------------------------
    def op_states(self) -> dict[str, dict]:
        return {nid: op.state_dict() for nid, op in self.ops.items() if self.contracts[nid].stateful}

    def load_op_states(self, states: Mapping[str, dict]) -> None:
        for nid, state in states.items():
            if nid in self.ops and self.contracts[nid].stateful:
                self.ops[nid].load_state_dict(state)

    def save_models(self, out_dir: str) -> list[str]:
        """Save every trained model under out_dir/NAME: an HF directory (a DDP group's first
        worker writes it), or for a sharded model its DCP checkpoint (every worker writes its own shards of the weights and of the
        optimizer state; nothing passes through one process) beside its config and tokenizer."""
        saved = []
        for name in self.setup.trainable:
            policy = self.resources[name].policy
            if policy.sharded:
                save_sharded_model(Path(out_dir) / name, policy, self._optimizer_of(name))
                if policy.lora is not None:  # beside the shards: what a frozen copy or export reads
                    policy.save(Path(out_dir) / name)
            elif self.setup.group is None or self.setup.group.rank == 0:  # DDP replicas are alike
                policy.save(Path(out_dir) / name)
            saved.append(name)
        return saved

    def _optimizer_of(self, model: str):
        """The optimizer of the op that trains ``model`` (its state is checkpointed with the
        weights when they are sharded), or None."""
        for nid, op in self.ops.items():
            node = next(n for n in self.setup.nodes if n.id == nid)
            if node.model == model and self.contracts[nid].role == "train":
                train_op: TrainOperator = op  # what a train-role instance holds (core.contract)
                return train_op.trainer.optimizer
        return None

    def _load_sharded(self, name: str, path: Path) -> None:
        """Resume a model from a sharded checkpoint (at any world size); the actor's own rollout
        engine, built from the spec's weights, gets the loaded ones. A rollout-only actor has no
        policy to load into: the session's weight sync after the resume brings them."""
        resource = self.resources[name]
        if resource.policy is None:
            return
        load_sharded_model(path, resource.policy, self._optimizer_of(name))
        resource.sync_generator()


def _as_they_are(parts: list) -> list:
    return parts
