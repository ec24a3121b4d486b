"""Will it fit? Per-actor memory budgets in `explain`, and `validate` refusing what cannot fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_flow import cli
from dapo_flow.errors import GraphError
from dapo_flow.graph.explain import explain
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.memory import GiB
from dapo_flow.graph.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]
DAPO = str(ROOT / "graphs/dapo.yaml")
RECIPE = str(ROOT / "graphs/recipes/dapo-qwen2.5-7b.yaml")
# Qwen2.5-7B's config.json (the numbers that size it)
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture
def qwen_7b(tmp_path) -> Path:
    """A model directory with Qwen2.5-7B's config.json only (enough to plan; nothing loads it)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    return tmp_path


# graphs/dapo.yaml trains on a DDP group sized to the devices (workers: auto); these tests start from one plain worker
ONE_WORKER = ("models.policy.train.workers=1", "models.policy.train.strategy=null")


def _placed(path: str, *sets: str, cluster: Cluster):
    base = ONE_WORKER if path == DAPO else ()
    return edit_file(path, parse_cli_edits([("set", s) for s in base + sets])).compile(cluster)


# the main job's prompts are short: with a prompt budget the context is 64 + 8 max_tokens
# (without one it is the model's maximum, 131072 for Qwen2.5)
SHORT = ("data.train.max_prompt_tokens=64", "data.val.max_prompt_tokens=64")


def test_the_main_job_has_a_budget_from_the_declared_shape():
    placed = _placed(DAPO, cluster=Cluster(cpus=2))
    budget = placed.budgets["model:policy"]
    names = [t.name for t in budget.terms]
    assert {"parameters", "gradients", "AdamW moments", "KV cache"} <= set(names)
    params = next(t for t in budget.terms if t.name == "parameters")
    assert params.bytes == 133_696 * 4  # tiny-adder's parameters in float32
    assert "CUDA context and workspaces" not in names  # a CPU actor


def test_a_group_shards_state_and_adds_gathered_copies(qwen_7b):
    def budget(workers: int):
        placed = _placed(DAPO, *SHORT, f"models.policy.path={qwen_7b}", f"models.policy.train.workers={workers}",
                         "models.policy.train.mixed_precision=bf16",
                         cluster=Cluster(cpus=64, gpus=8, gpu_mem_gib=1000))
        return {t.name: t.bytes for t in placed.budgets["model:policy"].terms}

    two, four = budget(2), budget(4)
    assert two["parameters (1/2 shard)"] == pytest.approx(2 * four["parameters (1/4 shard)"], rel=1e-6)
    assert two["gathered decoder layers (2)"] == four["gathered decoder layers (2)"]  # per layer, not sharded
    assert two["whole model gathered to generate"] > 14 * GiB  # 7.6B parameters in bf16
    assert two["CUDA context and workspaces"] > 0


def test_explain_prints_each_actors_budget_against_its_gpu(qwen_7b, capsys):
    args = ["explain", RECIPE, "--gpus", "16", "--nodes", "2", "--cpus", "128", "--gpu-mem-gib", "80",
            "--set", f"models.policy.path={qwen_7b}"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "model:policy     actor  cpus=1 gpus=1  loads policy" in out
    assert "group of 16 worker(s) on one PACK placement group (fsdp2" in out
    head = next(line for line in out.splitlines() if line.startswith("  model:policy, per worker of 16: peak "))
    assert "fits its 80.0 GiB GPU share" in head
    assert "vLLM engine (gpu_memory_utilization share)" in out and "parameters (1/16 shard)" in out


def test_validate_refuses_what_cannot_fit_naming_the_term_and_the_fix(qwen_7b, capsys):
    args = ["validate", RECIPE, "--gpus", "16", "--nodes", "2", "--cpus", "128", "--gpu-mem-gib", "24",
            "--set", f"models.policy.path={qwen_7b}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "dapo-qwen2.5-7b.yaml:" in err and "models.policy.train" in err
    assert "needs about" in err and "but has 24.0 GiB" in err and "the biggest term is" in err
    assert "fix: " in err


def test_one_worker_of_a_7b_model_without_sharding_names_more_workers(qwen_7b):
    with pytest.raises(GraphError) as info:
        _placed(DAPO, *SHORT, f"models.policy.path={qwen_7b}", cluster=Cluster(cpus=8, gpus=1, gpu_mem_gib=80))
    text = str(info.value)
    assert "AdamW moments" in text and "train.workers" in text  # 7.6B x 16 bytes of fp32 state


def test_a_share_of_a_gpu_has_a_share_of_its_memory(qwen_7b):
    small = "models.policy.path=" + str(qwen_7b)
    with pytest.raises(GraphError) as info:  # one worker: a group's workers never share a GPU
        _placed(DAPO, *SHORT, small, "models.policy.train.mixed_precision=bf16",
                "placement.models.policy.num_gpus=0.25", cluster=Cluster(cpus=16, gpus=8, gpu_mem_gib=80))
    assert "but has 20.0 GiB (0.25 of a 80 GiB GPU)" in str(info.value)


def test_unknown_gpu_size_or_shape_is_not_checked(tmp_path, capsys):
    assert cli.main(["explain", DAPO, "--gpus", "1", "--set", f"models.policy.path={tmp_path}",
                     "--set", "models.policy.train.workers=1"]) == 0
    out = capsys.readouterr().out
    assert "model:policy: unknown (no config.json to read at" in out


def test_a_ddp_group_holds_the_whole_state_on_every_worker(qwen_7b):
    """strategy: ddp places a training group (a worker per GPU) whose every worker budgets the
    full parameters, gradients and moments, with nothing gathered; cpu_offload (FSDP2's) is an error."""
    placed = _placed(DAPO, *SHORT, f"models.policy.path={qwen_7b}", "models.policy.train.workers=4",
                     "models.policy.train.strategy=ddp", cluster=Cluster(cpus=64, gpus=8, gpu_mem_gib=1000))
    stage = next(s for s in placed.stages if s.name == "model:policy")
    assert (stage.workers, stage.strategy, stage.is_group, stage.sharded) == (4, "ddp", True, False)
    terms = {t.name: t.bytes for t in placed.budgets["model:policy"].terms}
    assert terms["parameters"] == 7_615_616_512 * 4 and "whole model gathered to generate" not in terms
    assert not any("gathered" in name for name in terms)
    with pytest.raises(GraphError, match="cpu_offload is an FSDP2 setting"):
        _placed(DAPO, "models.policy.train.workers=2", "models.policy.train.strategy=ddp",
                "models.policy.train.cpu_offload=true", cluster=Cluster(cpus=2))
    one = _placed(DAPO, "models.policy.train.strategy=ddp", cluster=Cluster(cpus=2))
    assert not next(s for s in one.stages if s.name == "model:policy").is_group  # ddp of one: a plain worker


def test_bf16_mixed_precision_without_fsdp2_budgets_float32_state_and_bf16_compute(qwen_7b):
    """train.mixed_precision: bf16 on a DDP group (and one plain worker): torch.autocast, so every
    worker holds float32 parameters, gradients and moments, a bf16 copy of the weights its
    matmuls use, and smaller activations than in float32; explain says what runs."""
    def terms(*sets: str) -> dict[str, int]:
        placed = _placed(DAPO, *SHORT, f"models.policy.path={qwen_7b}", "models.policy.train.workers=4",
                         "models.policy.train.strategy=ddp", *sets, cluster=Cluster(cpus=64, gpus=8, gpu_mem_gib=1000))
        return {t.name: t.bytes for t in placed.budgets["model:policy"].terms}

    plain, mixed = terms(), terms("models.policy.train.mixed_precision=bf16")
    for name in ("parameters", "gradients", "AdamW moments"):
        assert mixed[name] == plain[name] == 7_615_616_512 * 4 * (2 if name == "AdamW moments" else 1)
    assert "bf16 weight copies (autocast)" in mixed and "bf16 weight copies (autocast)" not in plain
    assert mixed["activations saved for backward"] < plain["activations saved for backward"]
    assert not any("gathered" in name for name in mixed)
    placed = _placed(DAPO, "models.policy.train.mixed_precision=bf16", cluster=Cluster(cpus=2))
    text = explain(placed)
    assert "bf16 mixed precision (torch.autocast over fp32 master weights; gradients and AdamW state float32)" in text
    # a bfloat16 model: the trained copy still holds float32 master state (dtype is the other copies')
    bf16 = terms("models.policy.train.mixed_precision=bf16", "models.policy.dtype=bfloat16")
    assert {k: bf16[k] for k in ("parameters", "gradients", "AdamW moments")} == {
        k: mixed[k] for k in ("parameters", "gradients", "AdamW moments")}
    text = explain(_placed(DAPO, "models.policy.train.mixed_precision=bf16", "models.policy.dtype=bfloat16",
                           cluster=Cluster(cpus=2)))
    assert "torch.autocast over fp32 master weights; gradients and AdamW state float32; copies not trained in bfloat16" in text


def test_fsdp2_mixed_precision_over_a_bfloat16_model_budgets_float32_shards(qwen_7b):
    """The 7B recipe's setting (dtype bfloat16, fsdp2, mixed_precision bf16): float32 master
    shards, gradients and AdamW moments (verl's actor), gathers in bf16; explain says so."""
    def placed(*sets: str):
        return _placed(DAPO, *SHORT, f"models.policy.path={qwen_7b}", "models.policy.train.workers=4",
                       "models.policy.train.strategy=fsdp2", "models.policy.dtype=bfloat16", *sets,
                       cluster=Cluster(cpus=64, gpus=8, gpu_mem_gib=1000))

    def terms(*sets: str) -> dict[str, int]:
        return {t.name: t.bytes for t in placed(*sets).budgets["model:policy"].terms}

    mixed, plain = terms("models.policy.train.mixed_precision=bf16"), terms()
    assert mixed["parameters (1/4 shard)"] == 7_615_616_512 * 4 // 4
    assert mixed["AdamW moments (1/4 shard)"] == 2 * 7_615_616_512 * 4 // 4
    assert plain["parameters (1/4 shard)"] == 7_615_616_512 * 2 // 4  # no mixed precision: bf16 throughout
    assert mixed["gathered decoder layers (2)"] == plain["gathered decoder layers (2)"]  # bf16 gathers
    text = explain(placed("models.policy.train.mixed_precision=bf16"))
    assert "FSDP2: fp32 master weights, gradients and AdamW state sharded; parameters gathered in bf16" in text


def test_a_critic_is_priced_with_its_one_output_head_and_the_policys_context(qwen_7b):
    """A 7B critic (the policy's directory with `head: value`) holds the embeddings but a
    hidden x 1 head instead of the lm_head, has no vocabulary-wide logits, and reads rows as long
    as the policy generates (not its own 131072-token maximum)."""
    ppo = str(ROOT / "graphs/ppo.yaml")
    placed = _placed(ppo, "data.train.max_prompt_tokens=64", "data.val.max_prompt_tokens=64",
                     f"models.policy.path={qwen_7b}", f"models.critic.path={qwen_7b}", "models.critic.head=value",
                     cluster=Cluster(cpus=64, gpus=8, gpu_mem_gib=1000))
    policy = {t.name: t.bytes for t in placed.budgets["model:policy"].terms}
    critic = {t.name: t.bytes for t in placed.budgets["model:critic"].terms}
    h, v = QWEN_7B["hidden_size"], QWEN_7B["vocab_size"]
    assert policy["parameters"] - critic["parameters"] == (v - 1) * h * 4  # float32
    assert critic.get("logits and their gradients (float32)", 0) < policy["logits and their gradients (float32)"] / 100_000
    assert critic["activations saved for backward"] == policy["activations saved for backward"]  # same rows


def test_a_sleeping_colocated_engine_counts_only_while_it_generates(qwen_7b):
    """rollout.sleep (auto on GPU beside the trainer) frees vLLM's share during the update."""
    def budget(*sets: str):
        placed = _placed(RECIPE, f"models.policy.path={qwen_7b}", *sets,
                         cluster=Cluster(cpus=128, gpus=16, nodes=2, gpu_mem_gib=80))
        return placed.budgets["model:policy"]

    asleep, awake = budget(), budget("models.policy.rollout.sleep=false")
    engine = next(t for t in asleep.terms if t.name.startswith("vLLM engine"))
    assert engine.phases == ("generation",)
    assert not next(t for t in awake.terms if t.name.startswith("vLLM engine")).phases
    assert asleep.peak() < awake.peak()


def test_a_frozen_judge_is_priced_with_its_forward_and_its_logits(qwen_7b):
    """A 7B judge (output: likelihood) reading 1k-token responses 64 rows at a time needs
    their vocabulary-wide logits (~100 GB), which no GPU holds: validate says so and names the
    fix; chunked logprobs and smaller micro-batches fit."""
    judge = str(ROOT / "graphs/judge.yaml")
    sets = (*SHORT, f"models.policy.path={qwen_7b}", f"models.verifier.path={qwen_7b}", "rollout.max_tokens=1024",
            "models.policy.train.workers=4", "models.policy.train.mixed_precision=bf16", "train.micro_batch_size=2",
            "models.policy.train.grad_checkpointing=true", "models.policy.train.logprob_chunk_tokens=1024")
    cluster = Cluster(cpus=16, gpus=5, gpu_mem_gib=80)
    with pytest.raises(GraphError) as info:
        _placed(judge, *sets, cluster=cluster)
    text = str(info.value)
    assert "model:verifier" in text and "logits of the response" in text and "train.logprob_chunk_tokens" in text
    placed = _placed(judge, *sets, "models.verifier.train.logprob_chunk_tokens=1024", "judge.reward.micro_batch_size=4",
                     cluster=cluster)
    budget = placed.budgets["model:verifier"]
    names = {t.name: t for t in budget.terms}
    assert names["logits of one chunk (float32)"].phases == ("frozen forward (output head)",)
    assert budget.peak() < 80 * GiB and "weights" in names


# the 7B recipe on one node of 8 x 80 GB, a micro-batch of eight full-length rows (2048 + 20480)
EIGHT_ROWS = ("models.policy.train.workers=8", "models.policy.train.max_tokens_per_micro_batch=180224")


def test_sequence_parallelism_prices_a_workers_slice_of_the_activations(qwen_7b, capsys):
    """train.sequence_parallel 4: each worker keeps a quarter of the micro-batch's activations,
    so the recipe at 20k-token responses fits 8 x 80 GB with it and not without it."""
    base = ["explain", RECIPE, "--gpus", "8", "--nodes", "1", "--cpus", "64", "--gpu-mem-gib", "80",
            "--set", f"models.policy.path={qwen_7b}"] + [a for s in EIGHT_ROWS for a in ("--set", s)]
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert "needs about 121.2 GiB" in err and "but has 80.0 GiB" in err
    assert cli.main(base + ["--set", "models.policy.train.sequence_parallel=4"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel 4: 2 replica(s) of 4 workers" in out
    assert "model:policy, per worker of 8: peak" in out and "fits its 80.0 GiB GPU share" in out

    def terms(k: int) -> dict:
        placed = _placed(RECIPE, f"models.policy.path={qwen_7b}", *EIGHT_ROWS,
                         f"models.policy.train.sequence_parallel={k}",
                         cluster=Cluster(cpus=64, gpus=8, gpu_mem_gib=1000))
        return {t.name: t.bytes for t in placed.budgets["model:policy"].terms}

    one, four = terms(1), terms(4)
    for name in ("activations (layer inputs)", "one decoder layer recomputed", "layer backward temporaries"):
        assert four[name] == pytest.approx(one[name] / 4, rel=1e-6), name
    # the mask is the whole sequence's on every worker; sharded state is the group's as before
    assert four["attention masks (padded rows)"] == one["attention masks (padded rows)"]
    assert four["parameters (1/8 shard)"] == one["parameters (1/8 shard)"]


@pytest.mark.parametrize("sets, what, fix", [
    (("models.policy.train.sequence_parallel=8",), "28 query and 4 key/value heads",
     "fix: a sequence_parallel that divides both"),
    (("models.policy.train.sequence_parallel=3", "models.policy.train.workers=6"),
     "28 query and 4 key/value heads", "fix: a sequence_parallel that divides both"),
    (("models.policy.train.sequence_parallel=4", "models.policy.train.workers=6"), "must divide workers (6)",
     "set workers to a multiple of 4"),
    (("models.policy.train.sequence_parallel=2", "models.policy.train.strategy=ddp"), "strategy is ddp",
     "set strategy: fsdp2 (or null)"),
], ids=["heads", "kv-heads", "workers", "ddp"])
def test_validate_refuses_a_sequence_split_the_group_or_heads_do_not_allow(qwen_7b, capsys, sets, what, fix):
    """What is wrong, where (the train block's line) and the fix; exit 2 as every graph error."""
    args = ["validate", RECIPE, "--gpus", "16", "--nodes", "2", "--cpus", "128", "--gpu-mem-gib", "80",
            "--set", f"models.policy.path={qwen_7b}"] + [a for s in sets for a in ("--set", s)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "models.policy.train" in err and what in err and fix in err, err


def test_validate_refuses_a_sequence_split_of_a_critic(capsys):
    """Only a language model's logprobs are split: a critic's values run whole sequences."""
    args = ["validate", str(ROOT / "graphs/ppo.yaml"), "--set", "models.critic.train.workers=2",
            "--set", "models.critic.train.strategy=fsdp2", "--set", "models.critic.train.sequence_parallel=2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "models.critic.train.sequence_parallel" in err and "'critic' has head: value" in err
    assert "fix: remove sequence_parallel from this model" in err
