"""One rank of the FSDP2 tests (tests/models/test_fsdp.py): `python fsdp_worker.py CONFIG RANK`.

CONFIG (JSON) holds the group's `world`, `port` and optional `timeout`, and a list of `jobs` that
run one after another in the one process group (starting Python and importing torch costs far
more than a job). Each job builds a small Llama afresh on every rank (torch.manual_seed(0), as a
separate launch would), shards it with dapo_flow.models.fsdp, and takes `steps` clipped
policy-gradient steps on a fixed batch split across the ranks by token count, each loss
normalised by the global token count. Optionally it loads a sharded checkpoint first (`load`), or
saves one after `save_after` steps (`save`); `max_tokens` cuts each rank's rows into token-budget
micro-batches; `tie` ties the embedding and the lm_head. Rank 0 writes the losses and the full
weights to the job's `out`. With a `chunk` key (null or a size) the logprobs come from HFPolicy's
own path (dapo_flow.models.hf.response_logprobs_of, chunked or not) with an entropy bonus in the
loss, and rank 0 also writes its rows' logprobs and entropy scored without gradients on the
gathered weights.
"""

from __future__ import annotations

import gc
import json
import sys

import torch

torch.set_num_threads(1)  # two ranks on two cores

from dapo_flow.core.imports import skip_unneeded_transformers_imports  # noqa: E402

skip_unneeded_transformers_imports()  # as the training workers load models
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dapo_flow import algos  # noqa: E402
from dapo_flow.algos.balance import balanced_partitions, token_budget_micro_batches  # noqa: E402
from dapo_flow.models import fsdp  # noqa: E402
from dapo_flow.models.hf import response_logprobs_of  # noqa: E402

ROWS, PROMPT, RESPONSE, VOCAB = 8, 4, 6, 64


def main(cfg: dict, rank: int) -> None:
    world = cfg["world"]
    fsdp.init_group(rank, world, "127.0.0.1", cfg["port"], timeout_s=cfg.get("timeout", 60))
    for job in cfg["jobs"]:  # every rank runs the same jobs in the same order (their collectives pair up)
        run_job(job, rank, world)
        gc.collect()  # free the job's sharded model and optimizer before the next one
    fsdp.destroy_group()


def run_job(cfg: dict, rank: int, world: int) -> None:
    """One job in the group: its own model, optimizer and batch; nothing outlives it but its files."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=cfg.get("tie", False)))
    fsdp.shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if cfg.get("load"):
        fsdp.load_sharded(cfg["load"], model, optimizer)

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, VOCAB, (ROWS, PROMPT), generator=g)
    responses = torch.randint(1, VOCAB, (ROWS, RESPONSE), generator=g)
    lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    advantages = torch.randn(ROWS, generator=g)
    mask = torch.arange(RESPONSE)[None, :] < lengths[:, None]
    mine = torch.from_numpy(balanced_partitions(lengths.numpy(), world)[rank])

    def logp_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.cat([prompts[rows], responses[rows]], 1)
        if "chunk" in cfg:
            return response_logprobs_of(model, {"input_ids": ids}, responses[rows], mask[rows], temperature=0.7,
                                        with_entropy=True, chunk_tokens=cfg["chunk"])
        logits = model(input_ids=ids).logits[:, PROMPT - 1:-1].float()
        return algos.logprobs_from_logits(logits, responses[rows]), None

    losses = []
    for step in range(cfg["steps"]):
        if cfg.get("save") and step == cfg.get("save_after"):  # a checkpoint mid-run, as training writes them
            fsdp.save_sharded(cfg["save"], model, optimizer)
        with torch.no_grad():
            old = logp_of(mine)[0]
        tokens = fsdp.all_reduce_sum([float(mask[mine].sum())])[0]  # the global count
        optimizer.zero_grad()
        budget = cfg.get("max_tokens")
        micro = [torch.arange(len(mine)).numpy()]
        if budget:  # every rank runs the group's largest count of micro-batches (FSDP collectives)
            micro = token_budget_micro_batches(lengths[mine].numpy(), budget)
            count = int(fsdp.all_reduce_max([len(micro)])[0])
            if len(micro) < count:
                micro = balanced_partitions(lengths[mine].numpy(), count)
        total = 0.0
        for part in micro:
            rows = mine[torch.from_numpy(part)]
            sel = torch.from_numpy(part)
            logp, entropy = logp_of(rows)
            loss, _ = algos.policy_loss(old[sel], logp, advantages[rows][:, None].expand(-1, RESPONSE),
                                        mask[rows], agg="token-mean", num_tokens=tokens)
            if entropy is not None:  # an entropy bonus: gradients through the entropy too
                loss = loss - 0.01 * algos.agg_loss(entropy, mask[rows], "token-mean", num_tokens=tokens)
            (loss * world).backward()  # FSDP averages gradients over ranks: undo it, the loss is global
            total += float(loss)
        losses.append(fsdp.all_reduce_sum([total])[0])
        optimizer.step()
    scored = None
    if "chunk" in cfg:  # as HFPolicy scores without gradients: each rank its rows, gathered weights
        with fsdp.unsharded(model), torch.inference_mode():
            scored = [t.clone() for t in logp_of(mine)]
    full = {k: v.clone() for k, v in fsdp.full_state_dict(model).items()}
    if rank == 0:
        torch.save({"losses": losses, "params": full, "scored": scored}, cfg["out"])


if __name__ == "__main__":
    main(json.loads(open(sys.argv[1]).read()), int(sys.argv[2]))
