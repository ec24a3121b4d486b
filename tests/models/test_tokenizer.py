"""The char-level tokenizer: ids, BOS, round trip, save/load through AutoTokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dapo_flow.models.tokenizer import ARITHMETIC_CHARS, build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_special_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(ARITHMETIC_CHARS)
    assert tok.convert_tokens_to_ids(list("09+=")) == [4, 13, 14, 15]


@pytest.mark.parametrize("text", ["12+34=", "0", "99+99=198", "-5 + 3", ""])
def test_round_trip_one_token_per_char(tok, text):
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == "<s>" + text


def test_eos_and_unknown(tok):
    assert tok.decode([5, 6, tok.eos_token_id], skip_special_tokens=True) == "12"
    assert tok("a1", add_special_tokens=False)["input_ids"] == [tok.unk_token_id, 5]


def test_save_and_load_with_auto_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("7+8=")["input_ids"] == tok("7+8=")["input_ids"]
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.batch_decode([[1, 5, 2], [9]], skip_special_tokens=True) == ["1", "5"]


def test_duplicate_chars_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer("aa")
