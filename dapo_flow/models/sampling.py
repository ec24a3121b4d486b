"""Sampling settings and rollout results shared by the HF and vLLM backends.

Rollout logprobs follow verl: ``log_softmax(logits / temperature)`` of the sampled token,
before top-k / top-p truncation (greedy, ``temperature == 0``, reports ``log_softmax(logits)``),
so the trainer's recomputation with the same temperature matches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample ``n`` completions per prompt. ``temperature == 0`` means greedy."""

    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 16
    seed: int = 0

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


@dataclass
class Rollouts:
    """``len(prompts) * n`` samples; the samples of one prompt are contiguous, prompts in order.

    Shape: prompt_index, sample_idx, truncated: (samples,); response_ids / logprobs: ragged,
    one list per sample, EOS included when it was generated.
    """

    prompt_index: np.ndarray  # int32
    sample_idx: np.ndarray  # int32
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    truncated: np.ndarray  # bool: hit max_tokens without EOS
    tokens_generated: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)  # backend-specific timings

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else 0.0

    @staticmethod
    def layout(num_prompts: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_index, sample_idx) for ``n`` contiguous samples per prompt."""
        prompt_index = np.repeat(np.arange(num_prompts, dtype=np.int32), n)
        sample_idx = np.tile(np.arange(n, dtype=np.int32), num_prompts)
        return prompt_index, sample_idx
