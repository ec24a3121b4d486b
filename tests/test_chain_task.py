"""builtin:chain: splits, worked solutions, the verifier, and its use as a prompt source."""

from __future__ import annotations

import pytest

from dapo_flow.data.chain_task import ChainTask, evaluate, solution, verify_chain
from dapo_flow.data.prompts import load_prompts
from dapo_flow.errors import DataError
from dapo_flow.core import columns as C


def test_splits_are_seeded_disjoint_and_sized():
    task = ChainTask(train_size=300, val_size=50, seed=3)
    val, train = task.problems("val"), task.problems("train")
    assert (len(val), len(train)) == (50, 300)
    assert not {p.prompt for p in val} & {p.prompt for p in train}
    assert [p.prompt for p in ChainTask(train_size=300, val_size=50, seed=3).problems("val")] == [p.prompt for p in val]
    assert [p.prompt for p in ChainTask(train_size=300, val_size=50, seed=4).problems("val")] != [p.prompt for p in val]
    for p in val + train:
        assert 3 <= p.prompt.count("+") + p.prompt.count("-") + 1 <= 6
        assert p.answer == str(evaluate(p.prompt))


def test_val_does_not_depend_on_train_size():
    small, large = ChainTask(train_size=10, val_size=20), ChainTask(train_size=500, val_size=20)
    assert small.problems("val") == large.problems("val")


def test_solution_writes_every_partial_result():
    assert solution("37+45-19") == "37+45=82\n82-19=63\nAnswer: 63"
    assert solution("5-9") == "5-9=-4\nAnswer: -4"
    assert evaluate("60-97-72") == -109


@pytest.mark.parametrize("response, score", [
    ("37+45=82\n82-19=63\nAnswer: 63", 1.0),
    ("Answer: 63", 1.0),  # steps are not graded
    ("37+45=82\n82-19=63\nAnswer: 64", -1.0),
    ("37+45=82\n82-19=63", -1.0),  # cut off before the answer line
    ("Answer: 63\n63+1=64", -1.0),  # the answer must be the last line
    ("", -1.0),
])
def test_verifier_reads_only_the_last_answer_line(response, score):
    assert verify_chain(response, "63") == score


def test_negative_answers_verify():
    assert verify_chain("5-9=-4\nAnswer: -4", "-4") == 1.0


@pytest.mark.parametrize("options, fix", [
    ({"min_terms": 1}, "2 <= min_terms"),
    ({"min_terms": 4, "max_terms": 3}, "min_terms <= max_terms"),
    ({"low": 5, "high": 1}, "low <= high"),
    ({"low": 0, "high": 1, "min_terms": 2, "max_terms": 2, "train_size": 100}, "widen the range"),
    ({"val_size": 1.5}, "whole number"),
])
def test_bad_options_are_data_errors(options, fix):
    with pytest.raises(DataError, match=fix):
        ChainTask(**options)


def test_prompt_source_gives_chat_messages(char_tokenizer_fake_chat):
    table, skipped = load_prompts("builtin:chain", tokenizer=char_tokenizer_fake_chat, split="val", size=3,
                                  options={"val_size": 10, "train_size": 10})
    assert skipped == 0 and table.num_rows == 3
    row = table.slice(0, 1).to_pylist()[0]
    expression = ChainTask(val_size=10, train_size=10).problems("val")[0].prompt
    assert row[C.PROMPT_TEXT] == f"<|user|>Compute {expression}.<|assistant|>"  # through the chat template
    assert row[C.GROUND_TRUTH] == str(evaluate(expression))
    assert row[C.DATA_SOURCE] == "chain" and row[C.PROMPT_ID] == "val-0"


def test_unknown_option_names_the_allowed_ones(char_tokenizer_fake_chat):
    with pytest.raises(DataError, match="allowed: .*min_terms"):
        load_prompts("builtin:chain", tokenizer=char_tokenizer_fake_chat, options={"terms": 3})


@pytest.fixture
def char_tokenizer_fake_chat():
    """The char-level tokenizer with a minimal chat template (a stand-in for a chat model's)."""
    from dapo_flow.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+= -.<>|abcdefghijklmnopqrstuvwxyzC")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok
