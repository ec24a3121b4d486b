"""Sampling settings and rollout results shared by the HF and vLLM backends.

Rollout logprobs follow verl: ``log_softmax(logits / temperature)`` of the sampled token,
before top-k / top-p truncation (greedy, ``temperature == 0``, reports ``log_softmax(logits)``),
so the trainer's recomputation with the same temperature matches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def temperature_problems(temperature: float, generator_id: str,
                         generator_temperature: float) -> list[tuple[str, str, str]]:
    """Logprobs recomputed at another temperature than the sampling one do not match the
    sampling distribution (greedy sampling is scored at any temperature): the check of the
    `logprob` and `update` operators against their generator (``upstream_problems``)."""
    if generator_temperature <= 0 or temperature == generator_temperature:
        return []
    return [("temperature", f"temperature {temperature} differs from {generator_temperature} of "
             f"generate '{generator_id}': logprobs would not match the sampling distribution",
             f"set temperature: {generator_temperature}")]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample ``n`` completions per prompt. ``temperature == 0`` means greedy."""

    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 16
    seed: int = 0
    # one seed per prompt, in prompt order: a prompt's samples then depend on its seed only, not on
    # which other prompts share its batch, engine or replica (None: drawn from ``seed`` by position)
    prompt_seeds: tuple[int, ...] | None = None
    # record each token's top-k experts per MoE layer (routing replay; the hf backend, a model
    # with routers): Rollouts.routes
    record_routes: bool = False
    # an engine that left-pads prompts pads them to at least this many positions: the parts of a
    # generation batch (run.gen_stop_early) padded as the whole batch is, for the same logits
    prompt_width: int | None = None

    def seeds_for(self, num_prompts: int) -> list[int]:
        """Each prompt's seed: ``prompt_seeds``, or drawn from ``seed`` by position."""
        if self.prompt_seeds is not None:
            if len(self.prompt_seeds) != num_prompts:
                raise ValueError(f"{len(self.prompt_seeds)} prompt seeds for {num_prompts} prompts")
            return list(self.prompt_seeds)
        return np.random.default_rng(self.seed).integers(0, 2**31, size=num_prompts).tolist()

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


# --- a counter-based random stream per sample ------------------------------------------------------
# Each sample row has a 64-bit key (from its prompt's seed and its index); its t-th uniform is a
# hash of (key, t). Vectorised over rows, with no generator state: a row's draws do not depend on
# which rows share its batch, so replicas and training workers sample what one engine would.
# The hash is splitmix64 (Steele et al. 2014), the finaliser java.util.SplittableRandom uses.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """uint64 -> uint64, elementwise (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_keys(prompt_seeds: list[int], n: int) -> np.ndarray:
    """Keys of ``len(prompt_seeds) * n`` sample rows, prompt-major. Shape: (P * n,) uint64."""
    seeds = np.asarray(prompt_seeds, dtype=np.uint64).repeat(n)
    index = np.tile(np.arange(n, dtype=np.uint64), len(prompt_seeds))
    with np.errstate(over="ignore"):  # not a xor of two hashes: that is symmetric in (seed, index)
        return _splitmix64(_splitmix64(seeds) + index * np.uint64(0xD1B54A32D192ED03))


def uniforms(keys: np.ndarray, step: int) -> np.ndarray:
    """Each row's ``step``-th uniform in [0, 1). Shape: (S,) uint64 -> (S,) float64."""
    with np.errstate(over="ignore"):
        bits = _splitmix64(keys + np.uint64(step) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass
class Rollouts:
    """``len(prompts) * n`` samples; the samples of one prompt are contiguous, prompts in order.

    Shape: prompt_index, sample_idx, truncated: (samples,); response_ids / logprobs / versions:
    ragged, one list per sample, EOS included when it was generated.
    """

    prompt_index: np.ndarray  # int32
    sample_idx: np.ndarray  # int32
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    truncated: np.ndarray  # bool: hit max_tokens without EOS
    tokens_generated: int = 0
    seconds: float = 0.0
    # each token's policy version: of the weights that sampled it (an engine that takes new
    # weights mid-generation switches from one token to the next); None: the engine's version
    versions: list[list[int]] | None = None
    # per sample, its prompt + response tokens' expert choices (SamplingConfig.record_routes), -1
    # where none was recorded (the last response token, never fed to the model); None: not recorded
    # Shape: each (len(prompt) + len(response), layers, top_k) int16
    routes: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else 0.0

    def check(self, num_prompts: int, cfg: SamplingConfig, eos_ids: list[int]) -> None:
        """Raise ``ValueError`` if a backend broke the contract (layout, lengths, EOS, truncation)."""
        prompt_index, sample_idx = self.layout(num_prompts, cfg.n)
        problems = []
        if not (np.array_equal(self.prompt_index, prompt_index) and np.array_equal(self.sample_idx, sample_idx)):
            problems.append("samples are not n contiguous rows per prompt in prompt order")
        if not len(self.response_ids) == len(self.logprobs) == len(self.truncated) == len(prompt_index):
            problems.append("response_ids / logprobs / truncated lengths differ from prompts * n")
        if self.versions is not None and [len(v) for v in self.versions] != [len(r) for r in self.response_ids]:
            problems.append("versions are not one per response token")
        stop = set(eos_ids)
        for i, (ids, lps, trunc) in enumerate(zip(self.response_ids, self.logprobs, self.truncated)):
            ends_with_eos = bool(ids) and ids[-1] in stop
            if len(lps) != len(ids) or not 1 <= len(ids) <= cfg.max_tokens or stop & set(ids[:-1]):
                problems.append(f"sample {i}: {len(ids)} tokens, {len(lps)} logprobs, EOS only last")
            elif bool(trunc) != (not ends_with_eos) or (trunc and len(ids) != cfg.max_tokens):
                problems.append(f"sample {i}: truncated={bool(trunc)} but {len(ids)} tokens, EOS last: {ends_with_eos}")
            if len(problems) > 5:
                break
        if problems:
            raise ValueError("rollouts break the contract: " + "; ".join(problems))

    @classmethod
    def contiguous(cls, num_prompts: int, n: int, response_ids: list[list[int]],
                   logprobs: list[list[float]], truncated: list[bool], seconds: float,
                   versions: list[list[int]] | None = None, routes: list[np.ndarray] | None = None
                   ) -> "Rollouts":
        """Rollouts whose samples come ``n`` per prompt, in prompt order (what backends emit)."""
        prompt_index, sample_idx = cls.layout(num_prompts, n)
        return cls(
            prompt_index=prompt_index,
            sample_idx=sample_idx,
            response_ids=response_ids,
            logprobs=logprobs,
            truncated=np.asarray(truncated, dtype=bool),
            tokens_generated=sum(map(len, response_ids)),
            seconds=seconds,
            versions=versions,
            routes=routes,
        )

    def token_versions(self, version: int) -> list[list[int]]:
        """Each token's policy version: :attr:`versions`, or ``version`` for every token."""
        if self.versions is not None:
            return self.versions
        return [[version] * len(ids) for ids in self.response_ids]

    @staticmethod
    def layout(num_prompts: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_index, sample_idx) for ``n`` contiguous samples per prompt."""
        prompt_index = np.repeat(np.arange(num_prompts, dtype=np.int32), n)
        sample_idx = np.tile(np.arange(n, dtype=np.int32), num_prompts)
        return prompt_index, sample_idx
