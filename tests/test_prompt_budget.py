"""The prompt budget: `data.max_prompt_length`, `truncation` and `filter_overlong_prompts` (verl's
names), a source's `max_prompt_tokens` in their place, the model's context as the last bound, and
the memory estimate sized by the budget plus max_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pydantic
import pytest

from dapo_flow.data import stream
from dapo_flow.data.prompts import load_prompts
from dapo_flow.data.stream import OK, TokenizeBatch
from dapo_flow.errors import DataError, GraphError
from dapo_flow.core import columns as C
from dapo_flow.graph.explain import explain
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.data.prompt_budget import PromptBudget
from dapo_flow.graph.prompt_room import Room, source_budget
from dapo_flow.graph.spec import DataSpec
from dapo_flow.models.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DAPO = ROOT / "graphs" / "dapo.yaml"  # builtin:tiny-adder: a context of 64; rollout max_tokens 8
ONE_WORKER = ("models.policy.train.workers=1", "models.policy.train.strategy=null")
LONG = "11111+22222="  # 13 tokens with the char tokenizer's BOS
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": LONG, "answer": "33333"}, {"prompt": "3+3=", "answer": "6"}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def _data(**fields) -> DataSpec:
    return DataSpec.model_validate({"train": {"source": "p.jsonl"}, **fields})


def _budget(**fields) -> PromptBudget:
    data = _data(**fields)
    budget = source_budget(data, data.train, None)
    assert budget is not None
    return budget


def _compiled(*sets: str, cluster: Cluster | None = None):
    return edit_file(DAPO, parse_cli_edits([("set", s) for s in ONE_WORKER + sets])).compile(cluster or Cluster(cpus=2))


# --- the data block's fields --------------------------------------------------------------


@pytest.mark.parametrize("fields, match", [
    ({"truncation": "left"}, r"truncation: left handles prompts over the prompt budget, but data.train has none"),
    ({"filter_overlong_prompts": True}, r"filter_overlong_prompts: true handles .* set data.max_prompt_length"),
    ({"max_prompt_length": 8, "truncation": "right", "filter_overlong_prompts": True},
     r"truncation: right would never cut one: keep one of the two"),
    ({"max_prompt_length": 0}, r"greater than or equal to 1"),
    ({"truncation": "middle", "max_prompt_length": 8}, r"'error', 'left' or 'right'"),
])
def test_the_data_block_refuses_handling_without_a_budget(fields, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        _data(**fields)


def test_a_budget_of_every_source_is_enough_for_truncation():
    data = DataSpec.model_validate({"train": {"source": "a.jsonl", "max_prompt_tokens": 8},
                                    "val": {"source": "b.jsonl", "max_prompt_tokens": 4}, "truncation": "left"})
    assert [source_budget(data, s, None).tokens for s in (data.train, data.val)] == [8, 4]
    with pytest.raises(pydantic.ValidationError, match="data.val has none"):
        DataSpec.model_validate({"train": {"source": "a.jsonl", "max_prompt_tokens": 8},
                                 "val": {"source": "b.jsonl"}, "truncation": "left"})


def test_validate_names_the_data_block_and_its_line():
    with pytest.raises(GraphError) as info:
        _compiled("data.truncation=left")
    text = str(info.value)
    assert "dapo.yaml:" in text and "truncation: left handles prompts over the prompt budget" in text


def test_a_sources_max_prompt_tokens_takes_the_place_of_max_prompt_length():
    data = DataSpec.model_validate({"train": {"source": "a.jsonl", "max_prompt_tokens": 20},
                                    "val": {"source": "b.jsonl"}, "max_prompt_length": 8, "truncation": "left"})
    train, val = source_budget(data, data.train, None), source_budget(data, data.val, None)
    assert (train.tokens, train.overlong, train.name) == (20, "left", "max_prompt_tokens=20")
    assert (val.tokens, val.overlong, val.name) == (8, "left", "data.max_prompt_length=8")


# --- what the loaders do with a longer prompt ----------------------------------------------


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_keeps_the_last_or_first_tokens(jsonl, tok, truncation):
    full = tok(LONG)["input_ids"]
    assert len(full) == 13
    table, dropped = load_prompts(str(jsonl), tokenizer=tok, budget=_budget(max_prompt_length=8, truncation=truncation))
    assert dropped == 0 and table.num_rows == 3
    ids = table.column(C.PROMPT_IDS).to_pylist()
    assert ids[1] == (full[-8:] if truncation == "left" else full[:8])  # verl: ids[-n:] / ids[:n]
    assert table.column(C.PROMPT_TEXT).to_pylist()[1] == ("1+22222=" if truncation == "left" else "<s>11111+2")  # BOS + 7 chars
    assert ids[0] == tok("1+1=")["input_ids"] and ids[2] == tok("3+3=")["input_ids"]  # within: untouched


def test_filter_drops_counts_and_reports_whatever_on_bad_row_says(jsonl, tok):
    lines: list[str] = []
    table, dropped = load_prompts(str(jsonl), tokenizer=tok, on_bad_row="error", report=lines.append,
                                  budget=_budget(max_prompt_length=8, filter_overlong_prompts=True))
    assert dropped == 1
    assert table.column(C.PROMPT_TEXT).to_pylist() == ["1+1=", "3+3="]
    assert table.column(C.PROMPT_ID).to_pylist() == ["train-1", "train-3"]  # the kept rows' jsonl lines
    assert lines == [f"{jsonl} [train]: dropped 1 of 3 rows "
                     "(1 over data.max_prompt_length=8 (filter_overlong_prompts))"]


def test_error_names_the_row_and_the_settings_that_let_it_through(jsonl, tok):
    budget = _budget(max_prompt_length=8)
    with pytest.raises(DataError, match=r"p.jsonl: line 2: field 'prompt' has 13 tokens > data.max_prompt_length=8") as info:
        load_prompts(str(jsonl), tokenizer=tok, budget=budget)
    assert "data.truncation: left or right" in str(info.value) and "on_bad_row: skip" in str(info.value)
    table, dropped = load_prompts(str(jsonl), tokenizer=tok, budget=budget, on_bad_row="skip")  # a bad row
    assert (table.num_rows, dropped) == (2, 1)


def test_the_source_shorthand_keeps_its_messages(jsonl, tok):
    with pytest.raises(DataError, match=r"line 2: field 'prompt' has 13 tokens > max_prompt_tokens=8"):
        load_prompts(str(jsonl), tokenizer=tok, max_prompt_tokens=8)


def test_a_streamed_batch_applies_the_same_budget(tok, monkeypatch):
    monkeypatch.setitem(stream._TOKENIZERS, "char-tokenizer", tok)  # no model directory to load
    raw = pa.Table.from_pylist(ROWS)
    cut = TokenizeBatch("char-tokenizer", "f.parquet", "train", budget=_budget(max_prompt_length=8, truncation="left"))(raw)
    assert cut.column(C.PROMPT_IDS).to_pylist()[1] == tok(LONG)["input_ids"][-8:]
    kept = TokenizeBatch("char-tokenizer", "f.parquet", "train",
                         budget=_budget(max_prompt_length=8, filter_overlong_prompts=True))(raw)
    assert kept.column(OK).to_pylist() == [True, False, True]


# --- the model's context -------------------------------------------------------------------


def test_without_a_budget_the_context_bounds_the_prompt(jsonl, tok):
    room = Room("rollout", "policy", context=20, max_tokens=10)
    budget = source_budget(_data(), _data().train, room)
    assert (budget.tokens, budget.overlong) == (10, "error")
    with pytest.raises(DataError) as info:
        load_prompts(str(jsonl), tokenizer=tok, budget=budget)
    text = str(info.value)
    assert "line 2: field 'prompt' has 13 tokens > 10, the room model 'policy''s context of 20 positions" in text
    assert "data.max_prompt_length" in text and "lower max_tokens of 'rollout'" in text


def test_a_run_loads_no_row_longer_than_the_models_context(tmp_path, tok):
    """The main job without a budget: tiny-adder's context of 64 leaves 56 tokens beside max_tokens 8;
    the loader a run uses refuses a longer prompt, naming the row."""
    from dapo_flow.runtime.run_data import load_source

    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "1" * 60 + "+1=", "answer": "2"}) + "\n")
    placed = _compiled(f"data.train.source={path}")
    budget = placed.plan.prompt_budget(placed.plan.spec.data.train)
    assert (budget.tokens, budget.overlong) == (56, "error")
    with pytest.raises(DataError, match=r"long.jsonl: line 1: field 'prompt' has 64 tokens > 56, the room model "
                                        r"'policy''s context of 64 positions leaves beside generate node 'rollout''s"):
        load_source(placed.plan, placed.plan.spec.data.train, tok)


def test_validate_refuses_a_budget_that_overruns_the_context():
    with pytest.raises(GraphError) as info:
        _compiled("data.max_prompt_length=60")
    text = str(info.value)
    assert "data.max_prompt_length" in text
    assert ("a prompt of up to 60 tokens (data.max_prompt_length) and generate node 'rollout''s max_tokens 8 make "
            "rows of 68 positions, more than model 'policy''s context of 64 (max_position_embeddings)") in text
    assert "set data.max_prompt_length to at most 56, or max_tokens of 'rollout' to at most 4" in text
    with pytest.raises(GraphError, match=r"data.train.max_prompt_tokens"):
        _compiled("data.train.max_prompt_tokens=57")
    assert _compiled("data.max_prompt_length=56").plan.engine_context() == {"policy": 64}


def test_validate_refuses_max_tokens_that_fill_the_context():
    with pytest.raises(GraphError, match=r"max_tokens 64 of generate node 'rollout' fills model 'policy''s whole "
                                         r"context of 64 positions: no prompt fits beside it"):
        _compiled("rollout.max_tokens=64")


# --- the memory estimate -------------------------------------------------------------------


@pytest.fixture
def long_context_model(tmp_path) -> Path:
    """A config.json only (nothing loads it): a small Qwen2 shape with a 32k context."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "tie_word_embeddings": True}))
    return tmp_path


def test_the_estimate_sizes_rows_by_the_budget_plus_max_tokens(long_context_model):
    model = f"models.policy.path={long_context_model}"
    gpu = Cluster(cpus=16, gpus=1, gpu_mem_gib=1_000_000)
    unbounded = _compiled(model, cluster=gpu)
    bounded = _compiled(model, "data.max_prompt_length=24", cluster=gpu)
    assert bounded.plan.engine_context() == {"policy": 24 + 8}
    kv = {name: next(t.bytes for t in p.budgets["model:policy"].terms if t.name == "KV cache")
          for name, p in (("unbounded", unbounded), ("bounded", bounded))}
    assert kv["unbounded"] == kv["bounded"] * 32768 // 32  # rows of the whole context vs 24 + 8 positions
    assert bounded.budgets["model:policy"].total < unbounded.budgets["model:policy"].total / 100

    hint = "rows of 'policy' sized by its whole context (32768 positions): no prompt budget is set"
    assert hint in explain(unbounded) and hint not in explain(bounded)
    assert "48 per generation batch, at most 24 tokens each (a longer prompt: a bad row)" in explain(bounded)
    gpu_note = "GPU terms checked on one GPU setting only"
    assert gpu_note in explain(bounded) and gpu_note not in explain(_compiled(model))


def test_the_fit_check_names_the_budget_when_rows_take_the_whole_context(long_context_model):
    with pytest.raises(GraphError) as info:
        _compiled(f"models.policy.path={long_context_model}", cluster=Cluster(cpus=16, gpus=1, gpu_mem_gib=24))
    assert "no prompt budget is set: data.max_prompt_length prices rows at the budget plus max_tokens" in str(info.value)
    _compiled(f"models.policy.path={long_context_model}", "data.max_prompt_length=24",
              cluster=Cluster(cpus=16, gpus=1, gpu_mem_gib=24))  # the same job, sized by its budget, fits
