"""Evaluation metrics over groups of samples."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.groups import GroupIds, _as_numpy, _groups_for


def pass_at_k(group_ids: GroupIds, correct: np.ndarray | Sequence[float] | Tensor, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021, the Codex paper): the mean over prompts of
    ``1 - C(n - c, k) / C(n, k)``, a prompt having n samples (rows of its group) of which c are
    correct (``correct`` > 0); prompts with fewer than k samples are left out. pass@1 is the
    plain accuracy; pass@n is the share of prompts with any correct sample.

    Shape: group_ids (batch,), correct (batch,) -> scalar.
    """
    if k < 1:
        raise AlgoError(f"k must be >= 1, got {k}")
    ok = _as_numpy(correct, "correct")
    g = _groups_for(group_ids, ok.shape[0])
    n = np.bincount(g.codes, minlength=g.n_groups)
    c = np.bincount(g.codes[ok > 0], minlength=g.n_groups)
    n, c = n[n >= k], c[n >= k]
    if not n.size:
        raise AlgoError(f"pass@{k} needs a prompt with at least {k} samples")
    # C(n - c, k) / C(n, k) through log-gamma (float64), 0 where fewer than k samples are wrong
    lg = lambda x: torch.lgamma(torch.from_numpy(x.astype(np.float64))).numpy()  # noqa: E731
    wrong = n - c
    ratio = np.exp(lg(wrong + 1) - lg(np.maximum(wrong - k, 0) + 1) - lg(n + 1) + lg(n - k + 1))
    return float(np.mean(1.0 - np.where(wrong >= k, ratio, 0.0)))




def source_sums(sources: Sequence[str], values: np.ndarray) -> dict[str, tuple[float, int]]:
    """Per data source (as :func:`metric_safe` spells it): the sum of its rows' ``values`` and
    their count, so means over several batches add up exactly. Shape: sources (batch,), values
    (batch,)."""
    out: dict[str, tuple[float, int]] = {}
    for source, value in zip(sources, np.asarray(values, dtype=np.float64).tolist()):
        key = metric_safe(source)
        total, count = out.get(key, (0.0, 0))
        out[key] = (total + value, count + 1)
    return out


def metric_safe(name: str | None) -> str:
    """A data source's name as a metric-name part: MLflow takes letters, digits and ``_-. /``
    only (a verl ``data_source`` such as ``openai/gsm8k`` keeps its slash); anything else is ``_``."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name or "") or "_"
