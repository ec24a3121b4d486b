"""builtin:tool-arith: splits, the final-answer verifier, the prompt source and the score operator's
`reward: builtin:tool-arith`."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dapo_flow.data.prompts import load_prompts
from dapo_flow.data.reward_pool import RewardSpec, evaluate, resolve_reward
from dapo_flow.data.tool_arith import (TOOL_ARITH, ToolArithTask, call_text, final_answer, observation_text,
                                       operands, verify_tool_arith)
from dapo_flow.errors import DataError
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.registry import OPERATORS


def test_splits_are_disjoint_seeded_and_two_digit_by_default():
    task = ToolArithTask()
    train, val = task.problems("train"), task.problems("val")
    assert (len(val), len(train)) == (500, 90 * 90 - 500)
    assert not {p.prompt for p in train} & {p.prompt for p in val}
    assert ToolArithTask().problems("val") == val  # same seed, same order
    assert ToolArithTask(seed=1).problems("val") != val
    assert [p.index for p in val] == list(range(500))
    for p in train[:100] + val[:100]:
        a, b = operands(p.prompt)
        assert p.prompt == f"{a}*{b}=" and 10 <= a <= 99 and 10 <= b <= 99
        assert p.answer == str(a * b)


def test_options_and_val_independent_of_train_size():
    small = ToolArithTask(low=2, high=9, train_size=10, val_size=5)
    assert (len(small.problems("train")), len(small.problems("val"))) == (10, 5)
    assert all(2 <= x <= 9 for p in small.problems("train") + small.problems("val") for x in operands(p.prompt))
    bigger = ToolArithTask(low=2, high=9, train_size=40, val_size=5)
    assert bigger.problems("val") == small.problems("val")
    assert not {p.prompt for p in bigger.problems("train")} & {p.prompt for p in small.problems("val")}


@pytest.mark.parametrize("kwargs, match", [
    ({"low": 9, "high": 2}, "low <= high"),
    ({"low": 1, "high": 2, "val_size": 3, "train_size": 3}, "exceeds the 4 distinct pairs"),
    ({"val_size": 1.5}, "whole number"),
])
def test_bad_options_are_data_errors_naming_the_source(kwargs, match):
    with pytest.raises(DataError, match=f"{TOOL_ARITH}: .*{match}"):
        ToolArithTask(**kwargs)
    with pytest.raises(DataError, match=f"{TOOL_ARITH}: unknown split 'test'"):
        ToolArithTask().problems("test")


def test_the_turn_texts():
    assert call_text("12*34=") == "<call>calculator: 12*34</call>"
    assert observation_text("408") == "<result>408</result>"


@pytest.mark.parametrize("response, score", [
    ("<call>calculator: 12*34</call><result>408</result>408", 1.0),  # with the tool
    ("<call>calculator: 12*34</call><result>408</result> 408\n", 1.0),
    ("408", 1.0),  # direct, no tool
    (" 408 ", 1.0),
    ("<call>calculator: 12*34</call></s><result>408</result>408</s>", 1.0),  # decoded with specials
    ("<call>calculator: 12*34</call><result>408</result>", -1.0),  # empty final answer
    ("<call>calculator: 12*34</call>", -1.0),  # ended at the call: the call is the answer
    ("<call>calculator: 12*34</call><result>408</result>   ", -1.0),
    ("", -1.0),
    ("<call>calculator: 12*34</call><result>408</result>4080", -1.0),  # extra text
    ("<call>calculator: 12*34</call><result>408</result>408 done", -1.0),
    ("408<result>408</result>407", -1.0),  # the text after the LAST result counts
    ("<call>calculator: 1*1</call><result>1</result>408", 1.0),  # the tool is not checked, the answer is
    ("0408", -1.0),
    ("408<call>calculator: 12*34</call>", -1.0),
])
def test_verifier_reads_the_text_after_the_last_result(response, score):
    assert verify_tool_arith(response, "408") == score


def test_verifier_custom_rewards_and_final_answer():
    assert verify_tool_arith("408", "408", correct=2.0, wrong=0.0) == 2.0
    assert verify_tool_arith("", "408", correct=2.0, wrong=0.0) == 0.0
    assert final_answer("<call>calculator: 2*3</call><result>6</result> 6 ") == "6"
    assert final_answer(" 6<unk>") == "6"


def test_special_token_strings_are_the_char_tokenizers():
    from dapo_flow.data import tool_arith
    from dapo_flow.models.tokenizer import SPECIAL_TOKENS

    assert tool_arith._SPECIALS == SPECIAL_TOKENS


@pytest.fixture(scope="module")
def tok():
    from dapo_flow.recipes.tiny_agent import build_tokenizer

    return build_tokenizer()


def test_prompt_source(tok):
    table, skipped = load_prompts(TOOL_ARITH, tokenizer=tok, split="val", size=8)
    assert table.schema == C.prompt_schema() and (table.num_rows, skipped) == (8, 0)
    row = table.slice(0, 1).to_pylist()[0]
    first = ToolArithTask().problems("val")[0]
    assert row[C.PROMPT_TEXT] == first.prompt and row[C.GROUND_TRUTH] == first.answer
    assert row[C.PROMPT_IDS] == [tok.bos_token_id] + tok.encode(first.prompt, add_special_tokens=False)
    assert row[C.PROMPT_ID] == "val-0" and row[C.DATA_SOURCE] == "tool-arith"


def test_prompt_source_options_and_seed(tok):
    opts = {"low": 1, "high": 9, "train_size": 30, "val_size": 10}
    train, _ = load_prompts(TOOL_ARITH, tokenizer=tok, options=opts)
    val, _ = load_prompts(TOOL_ARITH, tokenizer=tok, split="val", options=opts)
    assert (train.num_rows, val.num_rows) == (30, 10)
    assert not set(train.column(C.PROMPT_TEXT).to_pylist()) & set(val.column(C.PROMPT_TEXT).to_pylist())
    other, _ = load_prompts(TOOL_ARITH, tokenizer=tok, options=opts, seed=1)
    assert other.column(C.PROMPT_TEXT) != train.column(C.PROMPT_TEXT)
    with pytest.raises(DataError, match=r"unknown options \['digits'\]; allowed: \['low', 'high'"):
        load_prompts(TOOL_ARITH, tokenizer=tok, options={"digits": 3})


def test_reward_builtin_resolves_and_sets_acc():
    spec = RewardSpec(TOOL_ARITH, correct=1.0, wrong=0.0)
    fn = resolve_reward(spec)
    assert evaluate(fn, spec, "<call>calculator: 12*34</call><result>408</result>408", "408") == (1.0, 1.0, ())
    assert evaluate(fn, spec, "<call>calculator: 12*34</call>", "408") == (0.0, 0.0, ())


def test_score_operator_with_the_builtin():
    cls = OPERATORS["score"]
    op = cls(cls.Params(reward=TOOL_ARITH), OpContext(node_id="score"))
    batch = pa.table({
        C.PROMPT_ID: pa.array(["train-0"] * 3), C.SAMPLE_IDX: pa.array([0, 1, 2], pa.int32()),
        C.RESPONSE_TEXT: pa.array(["<call>calculator: 12*34</call><result>408</result>408", "407",
                                   "<call>calculator: 12*34</call><result>408</result>"]),
        C.GROUND_TRUTH: pa.array(["408"] * 3),
    })
    out = op(batch)
    assert out.column(C.SCORE).to_pylist() == [1.0, -1.0, -1.0]
    assert out.column(C.ACC).to_pylist() == [1.0, 0.0, 0.0]
