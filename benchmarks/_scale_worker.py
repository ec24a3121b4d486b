"""One rank of benchmarks/scale.py: `python _scale_worker.py CONFIG RANK`.

Builds a Llama from scratch (same seed on every rank), shards it with dapo_flow.models.fsdp and
times policy-update steps on a fixed global batch, this rank's rows picked by
``balanced_partitions`` of the response lengths. A step is what the update's trainer
(dapo_flow/training/trainer.py) does for one mini-batch: micro-batches under a token budget
(every rank runs the group's largest count), forward with grad over the response positions
(``logits_to_keep``), DAPO token-mean clipped loss normalised by the global token count
(times the world size: FSDP averages gradients), backward, grad-norm clip, AdamW.

Communication is timed by wrapping the collectives FSDP2 and the step call
(``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` and the
functional ``all_reduce`` + ``wait_tensor`` that DTensor's grad-norm uses): on CPU/gloo they
are all blocking on the calling thread, so the wall time inside them is the communication the
step waits for (the transfer, plus waiting for the slower rank to arrive). The collectives of
one step (op, size, dtype) are recorded and replayed afterwards with no compute in between:
the transfer cost alone. Writes a JSON of per-step timings to ``<out>.rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

from dapo_flow import threads

CFG = json.loads(open(sys.argv[1]).read())
threads.configure(CFG["threads"])  # before transformers: 1 torch thread per core this rank owns

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dapo_flow import algos  # noqa: E402
from dapo_flow.algos.balance import balanced_partitions, token_budget_micro_batches  # noqa: E402
from dapo_flow.models import fsdp  # noqa: E402


class CommTimer:
    """Wall time the calling thread spends inside collectives, per op name, while ``on``."""

    def __init__(self) -> None:
        self.on, self.recording = False, False
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.recorded: list[tuple[str, int, str]] = []  # (op, input numel, dtype) of one step
        self.async_calls = 0
        self.originals: dict[str, object] = {}

    def reset(self) -> None:
        self.seconds.clear(), self.calls.clear(), self.bytes.clear()

    def wrap(self, owner, name: str, label: str, tensor_arg) -> None:
        original = getattr(owner, name)
        self.originals[label] = original

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            t = tensor_arg(args, kwargs)
            if self.recording and t is not None:
                self.recorded.append((label, t.numel(), str(t.dtype).removeprefix("torch.")))
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - start
            self.calls[label] += 1
            if t is not None:
                self.bytes[label] += t.numel() * t.element_size()
            if kwargs.get("async_op"):
                self.async_calls += 1  # not on CPU/gloo in FSDP2; would hide its wait from us
            return out

        setattr(owner, name, timed)


def _arg(pos: int, key: str):
    return lambda args, kwargs: kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)


def install_timer() -> CommTimer:
    timer = CommTimer()
    # FSDP2 (_fsdp_collectives) and dapo_flow.models.fsdp look these up on the module at call time
    timer.wrap(dist, "all_gather_single", "all_gather", _arg(1, "input_tensor"))
    timer.wrap(dist, "reduce_scatter_single", "reduce_scatter", _arg(1, "input"))
    timer.wrap(dist, "all_reduce", "all_reduce", _arg(0, "tensor"))
    # DTensor (the grad-norm of sharded gradients) reduces through the functional collectives:
    # the op launches, wait_tensor blocks
    import torch.distributed._functional_collectives as funcol

    timer.wrap(funcol, "all_reduce", "funcol_all_reduce", _arg(0, "self"))
    timer.wrap(funcol, "wait_tensor", "funcol_wait", lambda args, kwargs: None)
    return timer


def replay(recorded: list[tuple[str, int, str]], world: int, repeats: int) -> list[float]:
    """The recorded collectives of one step back to back, no compute between: seconds each time."""
    if world == 1 or not recorded:
        return [0.0] * repeats
    calls = []
    for op, numel, dtype in recorded:
        src = torch.ones(numel, dtype=getattr(torch, dtype))
        if op == "all_gather":
            calls.append(lambda s=src: dist.all_gather_single(torch.empty(s.numel() * world, dtype=s.dtype), s))
        elif op == "reduce_scatter":
            calls.append(lambda s=src: dist.reduce_scatter_single(torch.empty(s.numel() // world, dtype=s.dtype), s))
        elif op in ("all_reduce", "funcol_all_reduce"):
            calls.append(lambda s=src: dist.all_reduce(s))
    out = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for call in calls:
            call()
        out.append(time.perf_counter() - start)
    return out


def main(rank: int) -> None:
    cfg, world = CFG, CFG["world"]
    fsdp.init_group(rank, world, "127.0.0.1", cfg["port"], timeout_s=cfg.get("timeout", 120))
    m = cfg["model"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
        max_position_embeddings=m["positions"], tie_word_embeddings=m["tied"], attn_implementation="sdpa"))
    n_params = sum(p.numel() for p in model.parameters())
    fsdp.shard_model(model, reshard_after_forward=cfg["reshard_after_forward"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    timer = install_timer()  # after the model is built: sharding's own set-up is not a step

    rows, prompt, response = cfg["rows"], cfg["prompt"], cfg["response"]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, m["vocab"], (rows, prompt), generator=g)
    responses = torch.randint(1, m["vocab"], (rows, response), generator=g)
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=g)
    advantages = torch.randn(rows, generator=g)
    mask = torch.arange(response)[None, :] < lengths[:, None]
    responses = responses.masked_fill(~mask, 0)  # pad id 0 past each response
    mine = torch.from_numpy(balanced_partitions(lengths.numpy(), world)[rank])

    def logp_of(rows_: torch.Tensor) -> torch.Tensor:
        width = int(lengths[rows_].max())  # right padding to this micro-batch's longest response
        ids = torch.cat([prompts[rows_], responses[rows_, :width]], 1)
        attn = torch.cat([torch.ones(len(rows_), prompt, dtype=torch.long), mask[rows_, :width].long()], 1)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                       use_cache=False, logits_to_keep=width + 1).logits[:, :-1].float()
        return algos.logprobs_from_logits(logits, responses[rows_, :width])

    def micro_batches() -> list[torch.Tensor]:
        totals = (prompt + lengths[mine]).numpy()
        micro = token_budget_micro_batches(totals, cfg["max_tokens"])
        count = int(fsdp.all_reduce_max([len(micro)])[0])  # every rank: the group's largest count
        if len(micro) < count:
            micro = balanced_partitions(totals, count)
        return [torch.from_numpy(part) for part in micro]

    with torch.no_grad():  # old logprobs: the rollout's policy, computed once (not timed)
        old = torch.zeros(rows, response)
        for part in micro_batches():
            sel = mine[part]
            width = int(lengths[sel].max())
            old[sel, :width] = logp_of(sel)

    def step() -> dict:
        tokens = fsdp.all_reduce_sum([float(mask[mine].sum())])[0]  # the global count
        micro = micro_batches()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        t_fb = time.perf_counter()
        for i, part in enumerate(micro):
            sel = mine[part]
            logp = logp_of(sel)
            width = logp.shape[1]
            loss, _ = algos.policy_loss(old[sel, :width], logp, advantages[sel][:, None].expand(-1, width),
                                        mask[sel, :width], clip_low=0.2, clip_high=0.28, agg="token-mean",
                                        num_tokens=tokens)
            if cfg["sync_grads"] == "last":  # experiment: one reduce-scatter per step, not per micro-batch
                model.set_requires_gradient_sync(i == len(micro) - 1)
            (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already global
            total += float(loss)
        t_clip = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t_opt = time.perf_counter()
        optimizer.step()
        t_end = time.perf_counter()
        return {"loss": total, "fwd_bwd_s": t_clip - t_fb, "clip_s": t_opt - t_clip, "adamw_s": t_end - t_opt,
                "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
                "micro_batches": len(micro),
                "padded_tokens": sum(len(p) * (prompt + int(lengths[mine[p]].max())) for p in micro)}

    steps = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()  # steps start together; the barrier is outside the timing
        timer.reset()
        timer.on, timer.recording = True, i == cfg["warmup"]
        start = time.perf_counter()
        info = step()
        step_s = time.perf_counter() - start
        timer.on = timer.recording = False
        steps.append({"step_s": step_s, "comm_s": sum(timer.seconds.values()),
                      "comm_by_op": dict(timer.seconds), "calls": dict(timer.calls),
                      "comm_bytes": sum(timer.bytes.values()), "warmup": i < cfg["warmup"], **info})
    replay_s = replay(timer.recorded, world, cfg["replays"])
    out = {"rank": rank, "world": world, "params": n_params, "rows": len(mine),
           "tokens": int(prompt * len(mine) + lengths[mine].sum()), "response_tokens": int(lengths[mine].sum()),
           "global_tokens": int(prompt * rows + lengths.sum()), "global_response_tokens": int(lengths.sum()),
           "torch_threads": torch.get_num_threads(), "async_collectives": timer.async_calls,
           "recorded_collectives": len(timer.recorded), "steps": steps, "replay_s": replay_s}
    with open(f"{cfg['out']}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    if cfg.get("profile") and rank == 0:  # development aid: which ops does a step spend on?
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40), flush=True)
    elif cfg.get("profile"):
        step()
    fsdp.destroy_group()


if __name__ == "__main__":
    main(int(sys.argv[2]))
