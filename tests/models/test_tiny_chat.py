"""builtin:tiny-chat: a plain Hugging Face Qwen2 chat model directory, used as a user would use a
downloaded one. A short-recipe build (a few warm-start steps) stands in for the cached build:
the directory's shape and files are the same, only its accuracy differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_flow.data.chain_task import ChainTask
from dapo_flow.recipes import tiny_chat
from dapo_flow.recipes.chat_tokenizer import IM_END, IM_START

from model_builds import short_tiny_chat

SHORT = short_tiny_chat()

# the whole suite only: every test reads a model built for it (a short recipe, ~15 s)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_dir(short_tiny_chat_dir) -> Path:
    return short_tiny_chat_dir


def test_loads_with_auto_classes_as_a_qwen2_chat_model(chat_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert len(tok) == SHORT.vocab_size < config.vocab_size == SHORT.padded_vocab_size  # padded, as Qwen2's
    assert tok.eos_token == IM_END and tok.bos_token is None
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 5-7+3."}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == f"{IM_START}user\nCompute 5-7+3.{IM_END}\n{IM_START}assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:3] == [IM_START, "user", "Ċ"]  # specials are single tokens
    assert [tok.decode([i]) for i in tok("5-17", add_special_tokens=False)["input_ids"]] == ["5", "-", "1", "7"]
    assert tok.decode(tok("Answer: 12\n")["input_ids"]) == "Answer: 12\n"  # byte-level round trip


def test_shape_config_matches_the_built_config(chat_dir):
    from dapo_flow.models import model_config

    built = json.loads((chat_dir / "config.json").read_text())
    declared = model_config("builtin:tiny-chat")
    assert {k: built[k] for k in declared} == declared


# a second build (~20 s)
def test_build_info_and_determinism(chat_dir, tmp_path):
    info = json.loads((chat_dir / tiny_chat.BUILD_INFO).read_text())
    assert info["name"] == "tiny-chat" and info["tokenizer_size"] == SHORT.vocab_size
    assert info["val_sampled_accuracy"] == tiny_chat.sampled_accuracy(chat_dir, ChainTask(), SHORT)  # what it records
    again = tiny_chat.build_tiny_chat(tmp_path / "again", progress=False, recipe=SHORT)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (chat_dir / name).read_bytes(), name


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_the_dapo_chat_graph_runs_on_a_path_to_the_directory(chat_dir, backend, tmp_path, monkeypatch):
    """graphs/dapo-chat.yaml with `path:` at the directory (as with a downloaded model), 2 steps."""
    if backend == "vllm":
        pytest.importorskip("vllm")
    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime import execute
    from dapo_flow.tracking import read_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sets = [f"models.policy.path={chat_dir}", f"models.policy.backend={backend}", "models.policy.train.workers=1",
            "run.steps=2", "run.prompts_per_step=4", "run.gen_prompts_per_batch=4", "run.val_every=2",
            "run.checkpoint_every=2", "dynamic_sampling.max_gen_batches=1", "data.val.size=4",
            # the short-built model is never right: keep groups whose (overlong-shaped) rewards differ
            "dynamic_sampling.metric=reward"]
    graph = Path(__file__).parents[2] / "graphs" / "dapo-chat.yaml"
    placed = edit_file(graph, parse_cli_edits([("set", s) for s in sets])).compile(Cluster(cpus=2))
    summary = execute(placed, executor="local")
    assert summary["steps"] == 2
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert history["actor/grad_norm"]  # a step trained (one may keep no group: every sample truncated)
    assert all(v > 3 for _, v in history["val/response_len_mean"])  # multi-token BPE responses
