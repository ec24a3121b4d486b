"""Prompt data sources: builtin task, parquet (verl format), jsonl, bad-row handling."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_flow.core import columns as C
from dapo_flow.data.prompts import load_prompts
from dapo_flow.errors import DataError
from dapo_flow.models.tokenizer import build_char_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}=>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_char_tokenizer("0123456789+= -[]>abcdefghijklmnopqrstuvwxyz")
    t.chat_template = CHAT_TEMPLATE
    return t


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def verl_rows() -> list[dict]:
    return [
        {
            "data_source": "addition",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": 100 + i},
        }
        for i in range(4)
    ]


def test_builtin_addition(tok):
    table, skipped = load_prompts("builtin:addition", tokenizer=tok, split="val", size=8)
    assert table.schema == C.prompt_schema()
    assert (table.num_rows, skipped) == (8, 0)
    row = table.slice(0, 1).to_pylist()[0]
    a, b = row[C.PROMPT_TEXT].rstrip("=").split("+")
    assert row[C.GROUND_TRUTH] == str(int(a) + int(b))
    assert row[C.PROMPT_IDS] == tok(row[C.PROMPT_TEXT])["input_ids"]  # BOS + chars
    assert row[C.PROMPT_IDS][0] == tok.bos_token_id
    assert row[C.PROMPT_ID] == "val-0" and row[C.DATA_SOURCE] == "addition"
    assert len(set(table.column(C.PROMPT_ID).to_pylist())) == 8


def test_builtin_options_and_seed(tok):
    opts = {"low": 1, "high": 9, "train_size": 30, "val_size": 10}
    train, _ = load_prompts("builtin:addition", tokenizer=tok, options=opts)
    val, _ = load_prompts("builtin:addition", tokenizer=tok, split="val", options=opts)
    assert (train.num_rows, val.num_rows) == (30, 10)
    assert not set(train.column(C.PROMPT_TEXT).to_pylist()) & set(val.column(C.PROMPT_TEXT).to_pylist())
    other, _ = load_prompts("builtin:addition", tokenizer=tok, options=opts, seed=1)
    assert other.column(C.PROMPT_TEXT) != train.column(C.PROMPT_TEXT)


@pytest.mark.parametrize(
    "source, kwargs, match",
    [
        ("builtin:nope", {}, "unknown builtin data source 'builtin:nope'"),
        ("builtin:addition", {"options": {"hi": 3}}, r"unknown options \['hi'\]"),
        ("builtin:addition", {"on_bad_row": "ignore"}, "on_bad_row must be"),
        ("/no/such/file.parquet", {}, "/no/such/file.parquet does not exist"),
    ],
)
def test_source_errors(tok, source, kwargs, match):
    with pytest.raises(DataError, match=match):
        load_prompts(source, tokenizer=tok, **kwargs)


def test_verl_parquet_with_chat_template(tmp_path, chat_tok):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    table, skipped = load_prompts(str(path), tokenizer=chat_tok)
    assert (table.num_rows, skipped) == (4, 0)
    row = table.to_pylist()[2]
    assert row[C.PROMPT_TEXT] == "[user]2+1==>"
    assert row[C.PROMPT_IDS] == chat_tok(row[C.PROMPT_TEXT], add_special_tokens=False)["input_ids"]
    assert row[C.GROUND_TRUTH] == "3" and row[C.DATA_SOURCE] == "addition"
    assert row[C.PROMPT_ID] == "train-102"  # from extra_info.index


def test_verl_parquet_without_template_uses_content(tmp_path, tok):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    table, _ = load_prompts(str(path), tokenizer=tok, split="val", size=2)
    assert table.column(C.PROMPT_TEXT).to_pylist() == ["0+1=", "1+1="]
    assert table.column(C.PROMPT_ID).to_pylist() == ["val-100", "val-101"]


def test_flattened_reward_model_column(tmp_path, tok):
    path = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"prompt": ["1+2="], "reward_model.ground_truth": ["3"]}), path)
    table, _ = load_prompts(str(path), tokenizer=tok)
    assert table.column(C.GROUND_TRUTH).to_pylist() == ["3"]
    assert table.column(C.DATA_SOURCE).to_pylist() == ["flat"]  # file stem by default
    assert table.column(C.PROMPT_ID).to_pylist() == ["train-0"]


def test_jsonl_with_answer_key(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "1+1=", "sol": 2}, {"q": "2+2=", "sol": 4}])
    table, _ = load_prompts(str(path), tokenizer=tok, prompt_key="q", answer_key="sol")
    assert table.column(C.GROUND_TRUTH).to_pylist() == ["2", "4"]
    first = table.column(C.PROMPT_IDS).to_pylist()[0]
    assert first == [tok.bos_token_id, *tok("1+1=", add_special_tokens=False)["input_ids"]]


BAD_ROWS = [
    {"prompt": "1+1=", "answer": "2"},
    {"prompt": "2+2="},  # no ground truth
    {"prompt": "", "answer": "0"},  # empty prompt
    {"prompt": "11111+22222=", "answer": "33333"},  # too long for max_prompt_tokens=8
    {"prompt": "3+3=", "answer": "6"},
]


@pytest.mark.parametrize(
    "rows, match",
    [
        (BAD_ROWS[:2], r"p.jsonl: line 2: field 'reward_model.ground_truth \| ground_truth \| answer' is missing"),
        (BAD_ROWS[2:3], r"line 1: field 'prompt' is missing or empty"),
        (BAD_ROWS[3:4], r"line 1: field 'prompt' has 13 tokens > max_prompt_tokens=8"),
    ],
)
def test_bad_rows_error(tmp_path, tok, rows, match):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=match) as err:
        load_prompts(str(path), tokenizer=tok, max_prompt_tokens=8)
    assert "fix:" in str(err.value) and "on_bad_row: skip" in str(err.value)


def test_bad_rows_skip(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", BAD_ROWS)
    table, skipped = load_prompts(str(path), tokenizer=tok, max_prompt_tokens=8, on_bad_row="skip")
    assert skipped == 3
    assert table.column(C.PROMPT_TEXT).to_pylist() == ["1+1=", "3+3="]
    assert table.column(C.PROMPT_ID).to_pylist() == ["train-1", "train-5"]  # jsonl line numbers


def test_bad_parquet_row_names_row(tmp_path, tok):
    path = tmp_path / "v.parquet"
    rows = verl_rows()
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"v.parquet: row 1: field"):
        load_prompts(str(path), tokenizer=tok)
    table, skipped = load_prompts(str(path), tokenizer=tok, on_bad_row="skip")
    assert (table.num_rows, skipped) == (3, 1)


def test_file_format_errors(tmp_path, tok):
    bad_json = tmp_path / "b.jsonl"
    bad_json.write_text('{"prompt": "1+1=", "answer": "2"}\n{oops\n')
    with pytest.raises(DataError, match="b.jsonl: line 2: invalid JSON"):
        load_prompts(str(bad_json), tokenizer=tok)
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match="unsupported prompt file type '.csv'"):
        load_prompts(str(csv), tokenizer=tok)
    arr = tmp_path / "p.json"
    arr.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}]))
    table, _ = load_prompts(str(arr), tokenizer=tok)
    assert table.num_rows == 1


# --- sources that leave nothing to train on, and unreadable files: clear errors -----------


@pytest.mark.timeout(20)
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_empty_source_is_an_error(tmp_path, tok, suffix):
    path = tmp_path / f"empty{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    else:
        path.write_text("[]" if suffix == ".json" else "")
    with pytest.raises(DataError, match=rf"empty{suffix}: no usable prompts: it has no rows"):
        load_prompts(str(path), tokenizer=tok)


@pytest.mark.timeout(20)
def test_every_row_skipped_is_an_error_saying_why(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", BAD_ROWS[1:4])
    with pytest.raises(DataError) as err:
        load_prompts(str(path), tokenizer=tok, max_prompt_tokens=8, on_bad_row="skip")
    message = str(err.value)
    assert "p.jsonl: no usable prompts: all 3 rows read were skipped as bad rows" in message
    for why in ("1 no ground truth", "1 missing or empty `prompt`", "1 over max_prompt_tokens=8"):
        assert why in message
    assert "fix:" in message


@pytest.mark.timeout(20)
def test_sampler_refuses_an_empty_table():
    from dapo_flow.runtime.sampler import PromptSampler

    with pytest.raises(DataError, match="0 rows"):
        PromptSampler(C.prompt_schema().empty_table(), seed=0)


@pytest.mark.parametrize(
    "prompt, match",
    [
        (7, r"line 1: field 'prompt' is int 7, expected a string or a list of chat messages"),
        ({"text": "1+1="}, r"field 'prompt' is dict \{'text': '1\+1='\}, expected a string"),
        (["1+1="], r"field 'prompt' is a list but not of chat messages"),
    ],
)
def test_prompt_of_the_wrong_type_says_its_type(tmp_path, tok, prompt, match):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "answer": "2"}])
    with pytest.raises(DataError, match=match):
        load_prompts(str(path), tokenizer=tok)


def test_corrupt_parquet_is_a_data_error(tmp_path, tok):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[:-20])
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("prompt,answer\n1+1=,2\n")
    for path in (truncated, not_parquet):
        with pytest.raises(DataError, match=rf"{path.name}: cannot read as parquet: \w+"):
            load_prompts(str(path), tokenizer=tok)


def test_non_utf8_jsonl_names_the_line(tmp_path, tok):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "x"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: line 2: not UTF-8 text \(byte 0xe9"):
        load_prompts(str(path), tokenizer=tok)


def test_folder_of_parquet_shards_reads_every_shard_in_name_order(tmp_path, tok):
    rows = verl_rows()
    folder = tmp_path / "shards"
    folder.mkdir()
    # written out of order: the name decides the order, not the creation time
    pq.write_table(pa.Table.from_pylist(rows[2:]), folder / "part-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), folder / "part-00000.parquet")
    (folder / "_SUCCESS").write_text("")  # markers written by Spark & co. are not shards
    table, _ = load_prompts(str(folder), tokenizer=tok)
    assert table.column(C.PROMPT_ID).to_pylist() == ["train-100", "train-101", "train-102", "train-103"]
    seen = []
    load_prompts(str(folder), tokenizer=tok, read_parquet=lambda files: seen.append(files) or pq.read_table(files[0]))
    assert seen == [[folder / "part-00000.parquet", folder / "part-00001.parquet"]]


def test_folder_without_parquet_shards(tmp_path, tok):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(DataError, match=r"holds no .parquet files"):
        load_prompts(str(tmp_path), tokenizer=tok)


def test_json_nested_past_the_recursion_limit_is_a_data_error(tmp_path, tok):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}\n')
    with pytest.raises(DataError, match=r"deep.jsonl: line 1: JSON nested too deeply to read"):
        load_prompts(str(path), tokenizer=tok)


def test_a_row_the_chat_template_rejects_is_a_bad_row(tmp_path):
    strict = build_char_tokenizer("0123456789+= -[]>abcdefghijklmnopqrstuvwxyz")
    strict.chat_template = ("{% for m in messages %}{% if m['role'] != 'user' %}"
                            "{{ raise_exception('only user messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
            {"prompt": [{"role": "system", "content": "be brief"}], "answer": "0"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match=r"line 2: field 'prompt' cannot be rendered by the chat template: "
                                        r"TemplateError: only user messages"):
        load_prompts(str(path), tokenizer=strict)
    table, skipped = load_prompts(str(path), tokenizer=strict, on_bad_row="skip")
    assert (table.num_rows, skipped) == (1, 1)
