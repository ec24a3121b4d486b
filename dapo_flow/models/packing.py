"""Padding-free micro-batches (``train.pack``): a micro-batch's rows concatenated into one
sequence, so no position is spent on padding.

Each row keeps its own positions (0 at its first token), and attention stays inside each row:
with no attention mask and position ids that restart, transformers builds the block-diagonal
causal mask itself (``masking_utils.find_packed_sequence_indices``: SDPA and eager get it as a
mask, flash-attention's varlen kernels read the restarts directly). The logits are taken only
where a response token is predicted, gathered from the one sequence, and put back in the
(rows, longest response) layout every caller of the padded path reads.

Pure torch, no model: what :class:`~dapo_flow.models.hf.HFPolicy` packs and unpacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """Rows of prompt + response tokens as one sequence.

    Shape: input_ids, position_ids (1, T) long, T = the rows' total length; predict (N,) long:
    the position whose output predicts each response token, rows in order, N = the responses'
    total length; targets (N,) long: those tokens; response_mask (b, R) bool, R = ``width``:
    where each row's response tokens sit in the padded layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predict: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-response-token ``values`` in the padded layout, 0 at padding.
        Shape: (N,) -> (b, R)."""
        out = values.new_zeros(self.response_mask.shape)
        out[self.response_mask] = values
        return out


def pack_rows(prompt_ids: list[list[int]], response_ids: list[list[int]], width: int | None = None) -> Packed:
    """Concatenate ``prompt + response`` of each row. ``width``: the padded layout's response
    length (default: the longest response). A row's response token j is predicted at its
    offset + len(prompt) - 1 + j (every prompt has a token: the caller checks)."""
    width = max(map(len, response_ids), default=0) if width is None else width
    ids: list[int] = []
    pos: list[int] = []
    predict: list[int] = []
    targets: list[int] = []
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        start = len(ids)
        row = list(prompt) + list(response)
        ids += row
        pos += range(len(row))
        first = start + len(prompt) - 1
        predict += range(first, first + len(response))
        targets += response
        mask[i, : len(response)] = True
    return Packed(input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([pos], dtype=torch.long),
                  predict=torch.tensor(predict, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
                  response_mask=mask)
