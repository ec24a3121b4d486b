"""FSDP2 for a training group: the process group, sharding a causal LM, global counts, and
sharded checkpoints that load at another world size.

How a training group drives it (each of N workers, the same code on every rank):

1. ``init_group(rank, world_size, master_addr, master_port, device=...)`` once: the backend of
   the device the group trains on (:data:`BACKEND_OF_DEVICE`: gloo on CPU, nccl on CUDA);
   a peer that never joins is a :class:`~dapo_flow.errors.ModelError` after ``timeout_s``.
2. Build the model identically on every rank (same seed or the same weights file), then
   ``shard_model(model)``: ``fully_shard`` on each decoder layer, then on the root; an
   optimizer made afterwards holds only this rank's shards.
3. Per update, each rank gets its part of the batch (``algos.balance.balanced_partitions`` by
   response tokens, so ranks finish together). The loss of every micro-batch is normalised by
   the GLOBAL token (or sequence) count, ``all_reduce_sum`` of the ranks' local counts, and
   multiplied by ``world_size``: FSDP averages gradients over ranks, so the update equals the
   one a single worker makes on the whole batch (tests/models/test_fsdp.py checks it). Every
   rank must run the same number of forward/backward passes (each gathers shards from all
   ranks): with a token budget, each rank counts its micro-batches
   (``token_budget_micro_batches``), the group takes ``all_reduce_max`` of the counts, and a
   rank with fewer cuts its rows into that many ``balanced_partitions`` instead.
4. Checkpoints: ``save_sharded(dir, model, optimizer)`` on every rank writes its own shards
   (torch.distributed.checkpoint); ``load_sharded`` reads them back at any world size. Nothing
   passes through one process. ``full_state_dict`` gathers HF-named full weights (for an
   export or a rollout engine's weight sync).
"""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dapo_flow.errors import ModelError


#: the process-group backend for the device type a training group trains on
BACKEND_OF_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


#: how long a collective of the group waits for a member (torch's default for gloo): a worker may
#: wait in one for a member busy elsewhere, as rank 0 sending the weights to rollout engines that
#: are still generating while the others gather the shards with it; a member that died is named
#: by the run's driver long before
COLLECTIVE_TIMEOUT_S = 1800.0
_JOINED = False  # whether init_group formed this process's default group (destroy_group ends it)


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, *,
               device: str | torch.device = "cpu", timeout_s: float = 60.0) -> None:
    """Join the training group's process group, with the backend of ``device``, the device its
    model trains on (not whether this process could see a GPU: a CPU model beside one trains
    over gloo). Every member must come within ``timeout_s`` (the store's rendezvous); its
    collectives then wait up to :data:`COLLECTIVE_TIMEOUT_S`."""
    kind = torch.device(device).type
    if kind not in BACKEND_OF_DEVICE:
        raise ModelError(f"a training group trains on {', '.join(BACKEND_OF_DEVICE)}, not on device "
                         f"'{device}': set the model's device to one of those")
    backend = BACKEND_OF_DEVICE[kind]
    if dist.is_initialized():  # this process belongs to a group already: an in-process vLLM engine's
        if not (world_size == 1 and dist.get_world_size() == 1):
            raise ModelError(f"training worker {rank} of {world_size} cannot join its process group: "
                             f"this process already belongs to one of {dist.get_world_size()}; run the "
                             "training group in processes of its own (--executor ray)")
        # a group of one beside another of one: FSDP2 shards over it alike (and leaves it be)
    else:
        _form_group(backend, rank, world_size, master_addr, master_port, timeout_s)
    if backend == "nccl":
        index = torch.device(device).index
        torch.cuda.set_device(index if index is not None else
                              int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))


def _form_group(backend: str, rank: int, world_size: int, master_addr: str, master_port: int,
                timeout_s: float) -> None:
    global _JOINED
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, wait_for_workers=True,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        _JOINED = True
    except (RuntimeError, dist.DistError) as exc:  # a peer that never came, a port in use
        raise ModelError(f"training worker {rank} of {world_size} could not form its process group "
                         f"at {master_addr}:{master_port} within {timeout_s:g} s ({exc}); did every "
                         "worker start, and can they reach that address?") from None


def destroy_group() -> None:
    """Leave the group :func:`init_group` formed (one it found in place is not its to end)."""
    global _JOINED
    if _JOINED and dist.is_initialized():
        dist.destroy_process_group()
    _JOINED = False


def rank() -> int:
    """This process's rank in the group (0 outside one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to (each decoder layer and the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Every rank holds the full parameters inside the block: each FSDP module all-gathers once
    on entry (all ranks must enter together) and is not resharded after its forwards, so the
    forwards inside are local — any number per rank, e.g. sampling or scoring each rank's own
    rows. On exit the shards are back (and so are the reshard-after-forward settings)."""
    modules = fsdp_modules(model)
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in modules:
            m.unshard()
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (Llama, Qwen2, Mistral, ...: ``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__} (expected "
                         "`model.model.layers`, as Hugging Face causal LMs have): FSDP2 shards per layer")
    return list(layers)


def shard_model(model: nn.Module, *, mixed_precision: str | None = None, cpu_offload: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over all ranks of the group.
    ``mixed_precision="bf16"``: parameters and compute in bf16, gradient reduction in fp32 (the
    sharded fp32 parameters stay the optimizer's master weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif mixed_precision is not None:
        raise ModelError(f"mixed_precision {mixed_precision!r}: use null or bf16")
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def all_reduce_sum(values: Sequence[float], group: Any = None) -> list[float]:
    """Element-wise sums over the group's ranks (token / sequence counts, metrics), in float64.
    ``group``: a subgroup of ranks instead (a sequence-parallel group's replicas)."""
    return _all_reduce(values, dist.ReduceOp.SUM, group)


def all_reduce_max(values: Sequence[float], group: Any = None) -> list[float]:
    """Element-wise maxima over the group's ranks (e.g. the micro-batch count all ranks run)."""
    return _all_reduce(values, dist.ReduceOp.MAX, group)


def sequence_parallel_groups(k: int) -> tuple[Any, Any]:
    """This rank's two subgroups of a group of data-parallel replicas of ``k`` workers each:
    (its replica's k consecutive ranks, which split each sequence; the ranks at its place in
    every replica, which hold different rows: counts add up over these). Every rank creates
    every subgroup, in the same order (torch.distributed's rule for new_group)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world % k:
        raise ModelError(f"sequence_parallel {k} must divide the training group's {world} workers")
    mine = {}
    for r in range(world // k):
        ranks = list(range(r * k, (r + 1) * k))
        group = dist.new_group(ranks)
        if me in ranks:
            mine["sequence"] = group
    for s in range(k):
        ranks = list(range(s, world, k))
        group = dist.new_group(ranks)
        if me in ranks:
            mine["replicas"] = group
    return mine["sequence"], mine["replicas"]


def _all_reduce(values: Sequence[float], op, group: Any = None) -> list[float]:
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def save_sharded(path: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the model and optimizer state under ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with _quiet_when_alone():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def save_sharded_weights(path: Path | str, model: nn.Module) -> None:
    """:func:`save_sharded` of the weights alone (a model no optimizer trains)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    with _quiet_when_alone():
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path))


def load_sharded(path: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read a :func:`save_sharded` checkpoint into this model and optimizer (None: the weights
    only), whatever the world size it was saved at (DCP reshards on load): a sharded model of a
    group of any size, or a plain one in a process without a group (a run resumed on one
    unsharded worker)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        with _quiet_when_alone():
            dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _quiet_when_alone():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextmanager
def _quiet_when_alone() -> Iterator[None]:
    """DCP in a process of no group (one unsharded worker resuming or exporting a group's shards)
    warns on every call that it assumes a single process: that is the intent, so the warning is
    not passed on to the user."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load an unsharded optimizer's ``state_dict()`` (parameters by index, as a one-worker run
    checkpoints it) into this sharded model's optimizer: indices are the order of
    ``model.parameters()``, which fully_shard keeps; each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [name for name, p in model.named_parameters()]
    by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                for g in state["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict={}, optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True, strict=False))


def full_state_dict(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """The full (unsharded) weights on CPU under the model's own (HF) names (every rank takes
    part in the gathering; rank 0 gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
