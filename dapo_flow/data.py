"""Prompt data sources -> an Arrow table with ``columns.prompt_schema()``.

Sources: ``builtin:addition`` (see ``dapo_flow.tasks``), ``.parquet``, ``.jsonl`` and ``.json``
(a list of records). verl-format rows are understood: ``prompt`` as a chat message list
``[{role, content}]`` or a string, the answer at ``reward_model.ground_truth`` (a struct or a
flattened column), ``data_source``, ``extra_info.index``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import pyarrow as pa

from dapo_flow import columns as C
from dapo_flow.errors import DataError
from dapo_flow.tasks import ADDITION, AdditionTask

ANSWER_KEYS = ("reward_model.ground_truth", "ground_truth", "answer")  # tried in order
ADDITION_OPTIONS = ("low", "high", "train_size", "val_size")
FILE_SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class _Record:
    number: int  # position in the source: jsonl line number, parquet/json row index
    where: str  # "line 7" / "row 6": how a user finds the row in the source
    fields: dict[str, Any]


@dataclass
class _Row:
    record: _Record
    text: str  # what is tokenized: the raw prompt or the chat-templated messages
    answer: Any
    raw: bool  # a plain-string prompt: gets BOS; templated text carries its own specials
    ids: list[int] = field(default_factory=list)


def load_prompts(
    source: str,
    *,
    tokenizer: Any,
    split: str = "train",
    size: int | None = None,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    max_prompt_tokens: int | None = None,
    on_bad_row: Literal["error", "skip"] = "error",
    options: dict[str, Any] | None = None,
    read_parquet: Callable[[Path], pa.Table] | None = None,
) -> tuple[pa.Table, int]:
    """Read, template and tokenize prompts; returns (table, number of skipped bad rows).

    ``size`` keeps the first ``size`` rows of the source (before bad rows are dropped).
    ``seed`` and ``options`` (low/high/train_size/val_size) only apply to builtin tasks;
    ``split`` picks the builtin split and prefixes every ``prompt_id``.
    Bad rows (no ground truth, empty prompt, more than ``max_prompt_tokens`` tokens) raise
    :class:`DataError` with ``on_bad_row="error"`` and are counted and dropped with ``"skip"``.
    ``read_parquet`` replaces pyarrow's reader for .parquet files (the Ray executor passes
    Ray Data's, which reads a directory or object-store path of many files in parallel).
    """
    if on_bad_row not in ("error", "skip"):
        raise DataError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if source.startswith("builtin:"):
        records, default_source = _builtin_records(source, split, seed, options or {}), "addition"
        prompt_key, answer_key = "prompt", "ground_truth"
    else:
        if options:
            raise DataError(f"{source}: `options` only apply to builtin sources, got {sorted(options)}")
        records, default_source = _file_records(Path(source), read_parquet), Path(source).stem
    records = records[:size] if size is not None else records

    rows, bad = [], 0

    def reject(rec: _Record, field: str, problem: str, fix: str) -> None:
        nonlocal bad
        if on_bad_row == "error":
            raise DataError(
                f"{source}: {rec.where}: field '{field}' {problem}\n    fix: {fix}, "
                "or set on_bad_row: skip to drop such rows"
            )
        bad += 1

    answer_keys = (answer_key,) if answer_key else ANSWER_KEYS
    for rec in records:
        prompt = _get(rec.fields, prompt_key)
        text = _render(prompt, tokenizer) if prompt else ""
        if not text.strip():
            reject(rec, prompt_key, "is missing or empty", f"give every row a non-empty `{prompt_key}`")
            continue
        answer = next((a for k in answer_keys if (a := _get(rec.fields, k)) not in (None, "")), None)
        if answer is None:
            reject(rec, " | ".join(answer_keys), "is missing (no ground truth)",
                   "add the answer there or name its column with answer_key")
            continue
        rows.append(_Row(rec, text, answer, raw=isinstance(prompt, str)))

    for row, ids in zip(rows, _tokenize(tokenizer, [r.text for r in rows], [r.raw for r in rows])):
        row.ids = ids
    if max_prompt_tokens is not None:
        for row in [r for r in rows if len(r.ids) > max_prompt_tokens]:
            reject(row.record, prompt_key, f"has {len(row.ids)} tokens > max_prompt_tokens={max_prompt_tokens}",
                   "raise max_prompt_tokens or shorten the prompt")
        rows = [r for r in rows if len(r.ids) <= max_prompt_tokens]

    table = pa.table(
        {
            C.PROMPT_ID: _prompt_ids(split, [r.record for r in rows]),
            C.PROMPT_TEXT: [r.text for r in rows],
            C.PROMPT_IDS: [r.ids for r in rows],
            C.GROUND_TRUTH: [_as_text(r.answer) for r in rows],
            C.DATA_SOURCE: [str(r.record.fields.get("data_source") or default_source) for r in rows],
        },
        schema=C.prompt_schema(),
    )
    return table, bad


def _builtin_records(source: str, split: str, seed: int, options: dict[str, Any]) -> list[_Record]:
    if source != ADDITION:
        raise DataError(f"unknown builtin data source '{source}'; builtins: {ADDITION}")
    unknown = sorted(set(options) - set(ADDITION_OPTIONS))
    if unknown:
        raise DataError(f"{source}: unknown options {unknown}; allowed: {list(ADDITION_OPTIONS)}")
    task = AdditionTask(seed=seed, **options)
    return [
        _Record(p.index, f"problem {p.index}", {"prompt": p.prompt, "ground_truth": p.answer,
                                       "extra_info": {"index": p.index}})
        for p in task.problems(split)
    ]


def _file_records(path: Path, read_parquet: Callable[[Path], pa.Table] | None = None) -> list[_Record]:
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist (resolved: {path.resolve()})")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = (read_parquet or pq.read_table)(path)
        return [_Record(i, f"row {i}", r) for i, r in enumerate(table.to_pylist())]
    if suffix == ".json":
        data = _parse_json(path, path.read_text(encoding="utf-8"), "file")
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json prompt file must hold a list of records")
        return [_Record(i, f"record {i}", _as_record(path, r, f"record {i}")) for i, r in enumerate(data)]
    if suffix == ".jsonl":
        out = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                record = _as_record(path, _parse_json(path, line, f"line {n}"), f"line {n}")
                out.append(_Record(n, f"line {n}", record))
        return out
    raise DataError(f"{path}: unsupported prompt file type '{suffix}'; use one of {FILE_SUFFIXES}")


def _parse_json(path: Path, text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: {where}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def _as_record(path: Path, value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{path}: {where}: expected a JSON object, got {type(value).__name__}")
    return value


def _get(fields: dict[str, Any], key: str) -> Any:
    """``fields[key]``, or a dotted path through nested dicts ("reward_model.ground_truth")."""
    if key in fields:
        return fields[key]
    value: Any = fields
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _render(prompt: Any, tokenizer: Any) -> str:
    """The prompt as text: a message list goes through the chat template when there is one."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        return ""  # reported as an empty prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    # No template (e.g. the char-level tiny models): the contents, one message per line.
    return "\n".join(str(m["content"]) for m in prompt)


def _tokenize(tokenizer: Any, texts: list[str], raw: list[bool]) -> list[list[int]]:
    """Token ids; raw strings (not chat-templated) start with BOS when the tokenizer has one."""
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    return [
        [bos, *row] if bos is not None and is_raw and (not row or row[0] != bos) else list(row)
        for row, is_raw in zip(ids, raw)
    ]


def _prompt_ids(split: str, records: list[_Record]) -> list[str]:
    """``{split}-{extra_info.index}`` when every row has a distinct index, else the row position."""
    indices = [_get(r.fields, "extra_info.index") for r in records]
    if None in indices or len(set(map(str, indices))) != len(indices):
        indices = [r.number for r in records]
    return [f"{split}-{i}" for i in indices]


def _as_text(answer: Any) -> str:
    """Ground truth as a string: numbers via str, lists/dicts as JSON."""
    if isinstance(answer, str):
        return answer
    return json.dumps(answer) if isinstance(answer, (list, dict)) else str(answer)
