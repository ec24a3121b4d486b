"""Padding-free micro-batches (``train.pack``): a pass's rows packed end to end into a few
sequences, so almost no position is spent on padding.

Each row keeps its own positions (0 at its first token) and attention stays inside each row:
with no attention mask and position ids that restart, transformers builds the block-diagonal
causal mask itself (``masking_utils.find_packed_sequence_indices``: SDPA and eager get it as a
mask, flash-attention's varlen kernels read the restarts directly).

Rows go into bins as long as the pass's longest row, first fit by decreasing length, rather
than into one sequence: a dense mask's attention grows with the square of a sequence's length,
so one sequence of all the rows would cost SDPA more attention than padding saves when rows are
short; bins of the longest row's length never cost more attention than the padded batch, and
remove the padding but for a bin's unfilled tail (a segment of its own, attended by nobody).

The logits are taken only where a response token is predicted and put back in the (rows,
longest response) layout every caller of the padded path reads. Pure torch, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ID = 0  # a bin's unfilled tail: any id (its own segment; no row attends to it or reads it)


@dataclass(frozen=True)
class Packed:
    """Rows of prompt + response tokens packed into bins.

    Shape: input_ids, position_ids (bins, L) long, L = the longest row; predict (N,) long: the
    flat position (bin * L + offset) whose output predicts each response token, rows in order,
    N = the responses' total length; targets (N,) long: those tokens; response_mask (b, R) bool,
    R = ``width``: where each row's response tokens sit in the padded layout."""

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


def first_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into bins of at most ``capacity`` tokens: longest rows first, each
    into the first bin with room (first-fit decreasing). Every length must be <= capacity."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack_rows(prompt_ids: list[list[int]], response_ids: list[list[int]], width: int | None = None) -> Packed:
    """Pack ``prompt + response`` of each row into bins as long as the longest row. ``width``:
    the padded layout's response length (default: the longest response). A row's response token
    j is predicted at the row's offset + len(prompt) - 1 + j (every prompt has a token: the
    caller checks)."""
    width = max(map(len, response_ids), default=0) if width is None else width
    rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    capacity = max(map(len, rows), default=1)
    bins = first_fit_bins([len(r) for r in rows], capacity)
    ids = torch.full((len(bins), capacity), PAD_ID, dtype=torch.long)
    pos = torch.zeros((len(bins), capacity), dtype=torch.long)
    start = [0] * len(rows)  # each row's flat position
    for b, members in enumerate(bins):
        offset = 0
        for i in members:
            n = len(rows[i])
            ids[b, offset:offset + n] = torch.tensor(rows[i], dtype=torch.long)
            pos[b, offset:offset + n] = torch.arange(n)
            start[i] = b * capacity + offset
            offset += n
        pos[b, offset:] = torch.arange(capacity - offset)  # the tail: a segment of its own
    predict: list[int] = []
    targets: list[int] = []
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        first = start[i] + len(prompt) - 1
        predict += range(first, first + len(response))
        targets += response
        mask[i, : len(response)] = True
    return Packed(input_ids=ids, position_ids=pos, predict=torch.tensor(predict, dtype=torch.long),
                  targets=torch.tensor(targets, dtype=torch.long), response_mask=mask)
