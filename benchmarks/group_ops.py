"""Group-statistics benchmark: dapo_flow.algos against verl-style Python loops, same run.

What it times, at 512x16 rows (response length 1024) and 4096x16 rows (response length 256):

(a) operator path: per-sequence float32 scores + string group ids from an Arrow column
    -> per-sequence GRPO advantages and the dynamic-sampling keep mask
    (factorize once, sequence_advantages + keep_groups).
(b) token path: (batch, resp_len) token rewards + response mask + group ids -> token-level
    GRPO advantages (outcome_advantages) and the keep mask: with the Arrow uid column and a
    bool mask (into a new tensor, as the API returns by default, or into an `out=` buffer), and
    with int ids; with group members scattered over the batch, and adjacent (verl's layout from
    `repeat(interleave=True)`). The library runs this in torch/numpy (row sums as one
    matrix-vector read, group statistics on the per-sequence vector, one masked write); the
    parts line compares that write (torch.where) with the fused numba kernel of
    benchmarks/token_kernels.py, which left the library because no training path needs a
    token-level advantage tensor (`update` broadcasts the per-sequence one as a view).

Baseline: a per-row Python loop with verl's structure on verl's object array of uids (dict of
lists per uid, torch.mean / torch.std per group, per-row scalar updates; keep = np.std > 0 or a
singleton, with a set for membership instead of verl's list). Results must agree (allclose,
and dapo-flow's exact zeros for constant groups).
Also measured: the memory floor of (b), one read of the reward tensor plus one write of an
output tensor of its shape, with the output preallocated (`out.copy_(rewards)`, the floor of the
`out=` rows) and freshly allocated (the new-tensor row's floor: the cheaper of
`rewards.clone()`, torch's allocator, and `new_output(rewards)[0].copy_(rewards)`, a huge-page
mapping from benchmarks/token_kernels.py).

Run: python benchmarks/group_ops.py [--quick] [--json PATH]
Timings are the minimum over interleaved repetitions (the box may be shared).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from dapo_flow.algos import Groups, factorize, keep_groups, outcome_advantages, sequence_advantages
from dapo_flow.data.arrow_utils import group_codes
from token_kernels import masked_broadcast, new_output  # benchmarks/: not part of the library

SHAPES = [(512, 16, 1024), (4096, 16, 256)]  # prompts, samples per prompt, response length


# ---------------------------------------------------------------- verl-style loop baselines


def loop_grpo_scores(scores: torch.Tensor, index: np.ndarray, eps: float = 1e-6) -> torch.Tensor:
    """verl compute_grpo_outcome_advantage on per-sequence scores (loop, float32)."""
    scores = scores.clone()
    id2score: dict = defaultdict(list)
    id2mean, id2std = {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        if len(vals) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(vals)
            id2mean[idx], id2std[idx] = torch.mean(stacked), torch.std(stacked)
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
    return scores


def loop_grpo_tokens(token_rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """verl compute_grpo_outcome_advantage, token level."""
    return loop_grpo_scores(token_rewards.sum(dim=-1), index).unsqueeze(-1) * mask


def loop_keep(index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """verl DAPO recipe group filter (np.std > 0 or singleton), set membership."""
    uid2vals: dict = defaultdict(list)
    for uid, v in zip(index, values):
        uid2vals[uid].append(v)
    kept = {uid for uid, vals in uid2vals.items() if np.std(vals) > 0 or len(vals) == 1}
    return np.array([uid in kept for uid in index])


# ---------------------------------------------------------------- data


def make_batch(prompts: int, n: int, resp_len: int, seed: int = 0) -> dict:
    """DAPO-like batch: acc ±1 plus soft overlong penalties; a quarter of the groups all
    correct / all wrong and a tenth constant at the non-dyadic 0.7 (verl's one-ulp noise)."""
    rng = np.random.default_rng(seed)
    rows = prompts * n
    p_correct = rng.uniform(0, 1, prompts)
    p_correct[rng.uniform(size=prompts) < 0.25] = rng.integers(0, 2, 1)[0]
    acc = (rng.uniform(size=rows) < np.repeat(p_correct, n)).astype(np.float32)
    lengths = rng.integers(1, resp_len + 1, rows)
    penalty = np.minimum(-(lengths - 0.75 * resp_len) / (0.25 * resp_len), 0).astype(np.float32)
    scores = (2 * acc - 1 + penalty).astype(np.float32)
    constant = np.repeat(rng.uniform(size=prompts) < 0.1, n)
    scores[constant] = np.float32(0.7)
    order = rng.permutation(rows)  # group members are not adjacent
    uids = np.array([f"p{i // n}" for i in range(rows)], dtype=object)[order]
    scores, acc, lengths = scores[order], acc[order], lengths[order]
    acc[constant[order]] = 1.0
    token_rewards = torch.zeros(rows, resp_len)
    token_rewards[torch.arange(rows), torch.from_numpy(lengths - 1)] = torch.from_numpy(scores)
    mask = torch.arange(resp_len)[None, :] < torch.from_numpy(lengths)[:, None]
    return dict(
        scores=scores, acc=acc, uids=uids, uid_column=pa.chunked_array([pa.array(uids.tolist())]),
        token_rewards=token_rewards, mask=mask, constant=constant[order],
    )


# ---------------------------------------------------------------- timing


def groups_of(ids: object) -> Groups:
    """Codes as the operators make them: Arrow columns by group_codes, the rest by factorize."""
    return group_codes(ids) if isinstance(ids, (pa.Array, pa.ChunkedArray)) else factorize(ids)


def best_of(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Minimum wall time in ms per function, repetitions interleaved."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) * 1e3 for k, v in times.items()}


def check(ours: np.ndarray, ref: np.ndarray, constant: np.ndarray, what: str) -> str:
    """allclose off the constant groups, exact zeros on them; returns verl's noise there."""
    ok = np.allclose(ours[~constant], ref[~constant], rtol=1e-5, atol=1e-5)
    zeros = bool((ours[constant] == 0).all())
    if not (ok and zeros):
        raise SystemExit(f"{what}: results disagree (allclose={ok}, exact zeros={zeros})")
    noise = np.abs(ref[constant]).max() if constant.any() else 0.0
    diff = np.abs(ours - ref)[~constant].max()
    return f"{what}: agree; max |diff| {diff:.1e}, verl |adv| on constant groups <= {noise:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", metavar="PATH", help="also write the table and notes as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch (and kernel) threads; default torch's, the runtime gives actors 1 per CPU")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps, loop_reps = (5, 1) if args.quick else (50, 2)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"min of {reps} interleaved reps (loops: {loop_reps})")
    header = (f"{'rows x len':>14} {'path':<36} {'loop ms':>8} {'ours ms':>8} {'speedup':>8} "
              f"{'floor ms':>8} {'ours/floor':>10}")
    print(header)
    print("-" * len(header))
    notes, rows = [], []
    for prompts, n, resp_len in SHAPES:
        b = make_batch(prompts, n, resp_len)
        tag = f"{prompts}x{n} x {resp_len}"
        rewards, mask, uids, column = b["token_rewards"], b["mask"], b["uids"], b["uid_column"]
        out = torch.empty_like(rewards)
        codes = factorize(column).codes  # an int prompt-index column instead of uid strings

        # correctness first: ours (Arrow column / codes) against the loops (verl's object array)
        ref_a = loop_grpo_scores(torch.from_numpy(b["scores"]), uids).numpy()
        ref_b = loop_grpo_tokens(rewards, mask, uids).numpy()
        ref_keep = loop_keep(uids, b["acc"])
        const_tok = np.broadcast_to(b["constant"][:, None], rewards.shape)
        adv_a = sequence_advantages(b["scores"], column, "grpo")
        adv_b = outcome_advantages(rewards, mask, column, "grpo").numpy()
        notes.append(f"{tag} " + check(adv_a, ref_a, b["constant"], "(a)"))
        notes.append(f"{tag} " + check(adv_b, ref_b, const_tok, "(b)"))
        check(outcome_advantages(rewards, mask.float(), codes, "grpo").numpy(), ref_b, const_tok, "(b) f32 mask")
        for ids in (column, uids, codes):
            if not np.array_equal(keep_groups(ids, b["acc"]), ref_keep):
                raise SystemExit("keep masks disagree")

        def path_a() -> None:
            g = group_codes(column)  # once per batch, shared by both calls (as the operators do)
            sequence_advantages(b["scores"], g, "grpo")
            keep_groups(g, b["acc"])

        # verl's layout: `repeat(interleave=True)` puts a prompt's samples next to each other
        order = np.argsort(codes, kind="stable")
        adj = dict(rewards=rewards[torch.from_numpy(order)].contiguous(), mask=mask[torch.from_numpy(order)].contiguous(),
                   column=column.take(pa.array(order)), codes=codes[order], acc=b["acc"][order], uids=uids[order])
        adv_adj = outcome_advantages(adj["rewards"], adj["mask"], adj["column"], "grpo").numpy()
        notes.append(f"{tag} " + check(adv_adj, ref_b[order], const_tok[order], "(b) groups adjacent"))

        def path_b(ids: object, m: torch.Tensor, into: torch.Tensor | None, r: torch.Tensor = rewards,
                   acc: np.ndarray = b["acc"]) -> Callable[[], None]:
            def run() -> None:
                g = groups_of(ids)
                outcome_advantages(r, m, g, "grpo", out=into)
                keep_groups(g, acc)
            return run

        fast = best_of(
            {
                "a": path_a,
                "b_alloc": path_b(column, mask, None),
                "b": path_b(column, mask, out),
                "b_int": path_b(codes, mask, out),
                "b_adj": path_b(adj["column"], adj["mask"], out, adj["rewards"], adj["acc"]),
                "b_adj_int": path_b(adj["codes"], adj["mask"], out, adj["rewards"], adj["acc"]),
                "floor": lambda: out.copy_(rewards),
                "floor_alloc": lambda: rewards.clone(),
                "floor_fresh": lambda: new_output(rewards)[0].copy_(rewards),
                "read": lambda: torch.mv(rewards, rewards.new_ones(resp_len)),
                "write": lambda: out.fill_(0.0),
                "factorize": lambda: group_codes(column),
                "where": lambda: torch.where(mask, rewards[:, 0:1], rewards.new_zeros(()), out=out),
                "kernel_write": lambda: masked_broadcast(rewards[:, 0], mask, out),
            },
            reps,
        )
        slow = best_of(
            {
                "a": lambda: (loop_grpo_scores(torch.from_numpy(b["scores"]), uids), loop_keep(uids, b["acc"])),
                "b": lambda: (loop_grpo_tokens(rewards, mask, uids), loop_keep(uids, b["acc"])),
                "b_adj": lambda: (loop_grpo_tokens(adj["rewards"], adj["mask"], adj["uids"]),
                                  loop_keep(adj["uids"], adj["acc"])),
            },
            loop_reps,
        )
        # a fresh output's floor: the cheaper of torch's own allocation (clone) and a huge-page
        # mapping (new_output), each then written once
        fresh_floor = min(fast["floor_alloc"], fast["floor_fresh"])
        table = [
            ("(a) scores, str ids -> adv, keep", slow["a"], fast["a"], None),
            ("(b) str ids, bool mask, new tensor", slow["b"], fast["b_alloc"], fresh_floor),
            ("(b) str ids, bool mask, out= buffer", slow["b"], fast["b"], fast["floor"]),
            ("(b) int ids, bool mask, out= buffer", slow["b"], fast["b_int"], fast["floor"]),
            ("(b) adjacent, str ids, out= buffer", slow["b_adj"], fast["b_adj"], fast["floor"]),
            ("(b) adjacent, int ids, out= buffer", slow["b_adj"], fast["b_adj_int"], fast["floor"]),
        ]
        for name, loop_ms, ours_ms, floor_ms in table:
            floor_s = f"{floor_ms:8.2f} {ours_ms / floor_ms:10.2f}" if floor_ms else ""
            print(f"{tag:>14} {name:<36} {loop_ms:8.1f} {ours_ms:8.2f} {loop_ms / ours_ms:7.0f}x {floor_s}")
            rows.append({"shape": tag, "path": name, "loop_ms": loop_ms, "ours_ms": ours_ms,
                         "speedup": loop_ms / ours_ms, "floor_ms": floor_ms,
                         "ours_over_floor": ours_ms / floor_ms if floor_ms else None})
        notes.append(
            f"{tag} (b) parts: factorize str {fast['factorize']:.2f}, row-sum read {fast['read']:.2f}, "
            f"masked write: torch.where {fast['where']:.2f}, kernel {fast['kernel_write']:.2f}, "
            f"plain fill {fast['write']:.2f} ms; "
            f"two-pass bound (read + plain write) = {(fast['read'] + fast['write']) / fast['floor']:.2f}x floor"
        )
        notes.append(
            f"{tag} (b) fresh-output floors: rewards.clone() {fast['floor_alloc']:.2f} ms, "
            f"new_output (huge pages) + copy_ {fast['floor_fresh']:.2f} ms, copy_ into a buffer {fast['floor']:.2f} ms"
        )
    print()
    for line in notes:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                               "reps": reps, "rows": rows, "notes": notes}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
