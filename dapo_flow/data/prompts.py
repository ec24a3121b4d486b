"""Prompt data sources -> an Arrow table with ``columns.prompt_schema()``.

Sources: ``reasoning_gym:NAME`` (a reasoning-gym generator, see
``dapo_flow.data.reasoning_gym``), ``verifiers:ENV_ID`` (a verifiers environment's taskset, see
``dapo_flow.envs.verifiers_env``), ``builtin:addition`` (see ``dapo_flow.data.tasks``), ``builtin:chain`` (chat messages,
see ``dapo_flow.data.chain_task``), ``builtin:tool-arith`` (``a*b=`` for a calculator-using agent,
see ``dapo_flow.data.tool_arith``), ``.parquet``, ``.jsonl`` and ``.json``
(a list of records). verl-format rows are understood: ``prompt`` as a chat message list
``[{role, content}]`` or a string, the answer at ``reward_model.ground_truth`` (a struct or a
flattened column), ``data_source``, ``extra_info.index``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.errors import DataError
from dapo_flow.data.prompt_budget import PromptBudget
from dapo_flow.data import reasoning_gym
from dapo_flow.envs import verifiers_env
from dapo_flow.data.chain_task import CHAIN, CHAIN_OPTIONS, ChainTask, question
from dapo_flow.data.tasks import ADDITION, AdditionTask
from dapo_flow.data.tool_arith import TOOL_ARITH, TOOL_ARITH_OPTIONS, ToolArithTask

ANSWER_KEYS = ("reward_model.ground_truth", "ground_truth", "answer")  # tried in order
ADDITION_OPTIONS = ("low", "high", "train_size", "val_size")
# builtin source -> (task class, its options, the row's prompt from the problem's prompt)
BUILTIN_TASKS: dict[str, tuple[type, tuple[str, ...], Callable[[str], Any]]] = {
    ADDITION: (AdditionTask, ADDITION_OPTIONS, lambda prompt: prompt),
    CHAIN: (ChainTask, CHAIN_OPTIONS, lambda prompt: [{"role": "user", "content": question(prompt)}]),
    TOOL_ARITH: (ToolArithTask, TOOL_ARITH_OPTIONS, lambda prompt: prompt),
}
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
    read_parquet: "ParquetReader | None" = None,
    budget: PromptBudget | None = None,
    report: Callable[[str], None] | None = None,
    config: dict[str, Any] | None = None,
    avoid: set[str] = frozenset(),
) -> tuple[pa.Table, int]:
    """Read, template and tokenize prompts; returns (table, number of dropped rows).

    ``size`` keeps the first ``size`` rows of the source (before bad rows are dropped).
    ``seed`` and ``options`` (low/high/train_size/val_size) only apply to builtin tasks;
    ``split`` picks the builtin split and prefixes every ``prompt_id``.
    Bad rows (no ground truth, empty prompt, more than ``max_prompt_tokens`` tokens) raise
    :class:`DataError` with ``on_bad_row="error"`` and are counted and dropped with ``"skip"``.
    ``budget`` (the graph's prompt budget, ``graph.prompt_room.source_budget``) replaces
    ``max_prompt_tokens``: a longer prompt is a bad row, dropped and counted, or cut to its last or
    first tokens, as it says. ``report`` gets one line saying how many rows were dropped and why.
    ``read_parquet`` replaces pyarrow's reader for .parquet files (the Ray executor passes
    its Ray tasks); it is given one file or the name-ordered list of a folder's ``*.parquet`` shards.
    A source that leaves no usable row (empty, or every row bad and skipped) is a DataError:
    training could never draw a prompt from it.
    ``reasoning_gym:NAME`` (:mod:`dapo_flow.data.reasoning_gym`): the generator's first ``size``
    items at ``seed`` with its ``config``; those whose question is in ``avoid`` (a train split's,
    when this is validation) are dropped and reported.
    """
    if on_bad_row not in ("error", "skip"):
        raise DataError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    records, default_source, keys = _source_records(source, split, size, seed, config or {}, options or {},
                                                    avoid, report, read_parquet)
    prompt_key, answer_key = keys or (prompt_key, answer_key)
    records = records[:size] if size is not None else records
    table, skipped, _ = prompt_table(records, source=source, default_source=default_source,
                                  tokenizer=tokenizer, split=split, prompt_key=prompt_key,
                                  answer_key=answer_key, max_prompt_tokens=max_prompt_tokens,
                                  on_bad_row=on_bad_row, budget=budget)
    if table.num_rows == 0:
        raise DataError(_no_rows_message(source, len(records), skipped))
    if skipped and report is not None:
        report(f"{source} [{split}]: dropped {sum(skipped.values())} of {len(records)} rows "
               f"({', '.join(f'{n} {why}' for why, n in skipped.most_common())})")
    return table, sum(skipped.values())


def _source_records(source: str, split: str, size: int | None, seed: int, config: dict[str, Any],
                    options: dict[str, Any], avoid: set[str], report: Callable[[str], None] | None,
                    read_parquet: "ParquetReader | None") -> tuple[list["_Record"], str, tuple[str, str] | None]:
    """The source's records, the data source they are labelled with, and the (prompt, answer)
    keys of a library or builtin source's records (None: a file's, the caller's keys)."""
    if reasoning_gym.is_gym(source):
        return _gym_records(source, seed, size, config, options, avoid, report), source, ("prompt", "ground_truth")
    if verifiers_env.is_verifiers(source):
        records = [_Record(i, f"task {i}", fields)
                   for i, fields in verifiers_env.records(source, config, options, size)]
        return records, source, ("prompt", "ground_truth")
    if source.startswith("builtin:"):
        return (_builtin_records(source, split, seed, options), source[len("builtin:"):],
                ("prompt", "ground_truth"))
    if options or config:
        raise DataError(f"{source}: `options` and `config` only apply to builtin, reasoning_gym and verifiers "
                        f"sources, got {sorted({**options, **config})}")
    return _file_records(Path(source), read_parquet), Path(source).stem, None


def prompt_table(records: list["_Record"], *, source: str, default_source: str, tokenizer: Any,
                 split: str, prompt_key: str = "prompt", answer_key: str | None = None,
                 max_prompt_tokens: int | None = None, on_bad_row: str = "error",
                 first_id: int | None = None, budget: PromptBudget | None = None,
                 ) -> tuple[pa.Table, Counter[str], list[int]]:
    """Records -> the prompt table of their usable rows (templated, tokenized), why how many
    were dropped, and the kept records' numbers. ``first_id``: number the rows' prompt ids from
    here in order (a stream's batches); default: ``extra_info.index`` when distinct, else the
    row position. ``budget`` (default: ``max_prompt_tokens``, longer prompts bad rows) bounds
    the prompts' tokens (:func:`_apply_budget`)."""
    if budget is None and max_prompt_tokens is not None:
        budget = PromptBudget.of_source(max_prompt_tokens)
    rows: list[_Row] = []
    skipped: Counter[str] = Counter()  # why -> how many rows were dropped for it

    def reject(rec: _Record, field: str, problem: str, fix: str, why: str) -> None:
        if on_bad_row == "error":
            raise DataError(
                f"{source}: {rec.where}: field '{field}' {problem}\n    fix: {fix}, "
                "or set on_bad_row: skip to drop such rows"
            )
        skipped[why] += 1

    answer_keys = (answer_key,) if answer_key else ANSWER_KEYS
    for rec in records:
        row = _usable_row(rec, prompt_key, answer_keys, tokenizer, reject)
        if row is not None:
            rows.append(row)

    for row, ids in zip(rows, _tokenize(tokenizer, [r.text for r in rows], [r.raw for r in rows])):
        row.ids = ids
    if budget is not None:
        rows = _apply_budget(rows, budget, tokenizer, lambda rec, problem, why: reject(
            rec, prompt_key, problem, budget.fix, why), skipped)

    ids = (_prompt_ids(split, [r.record for r in rows]) if first_id is None
           else [f"{split}-{first_id + k}" for k in range(len(rows))])
    table = pa.table(
        {
            C.PROMPT_ID: ids,
            C.PROMPT_TEXT: [r.text for r in rows],
            C.PROMPT_IDS: [r.ids for r in rows],
            C.GROUND_TRUTH: [_as_text(r.answer) for r in rows],
            C.DATA_SOURCE: [str(r.record.fields.get("data_source") or default_source) for r in rows],
        },
        schema=C.prompt_schema(),
    )
    return table, skipped, [r.record.number for r in rows]


def _usable_row(rec: "_Record", prompt_key: str, answer_keys: tuple[str, ...], tokenizer: Any,
                reject: Callable[..., None]) -> "_Row | None":
    """A record's row (its prompt templated, its ground truth), or None after ``reject(record,
    field, problem, fix, why)`` names what makes it unusable."""
    prompt = _get(rec.fields, prompt_key)
    wrong_type = _prompt_type_problem(prompt)
    if wrong_type:
        reject(rec, prompt_key, wrong_type, f"make every `{prompt_key}` a string or a list of "
               "chat messages [{role, content}]", f"`{prompt_key}` of the wrong type")
        return None
    try:
        text = _render(prompt, tokenizer) if prompt else ""
    except Exception as exc:  # noqa: BLE001 - the model's chat template rejects this row
        reject(rec, prompt_key, f"cannot be rendered by the chat template: {_first_line(exc)}",
               "give the messages the roles and fields the model's chat template accepts",
               "rejected by the chat template")
        return None
    if not text.strip():
        reject(rec, prompt_key, "is missing or empty", f"give every row a non-empty `{prompt_key}`",
               f"missing or empty `{prompt_key}`")
        return None
    answer = next((a for k in answer_keys if (a := _get(rec.fields, k)) not in (None, "")), None)
    if answer is None:
        reject(rec, " | ".join(answer_keys), "is missing (no ground truth)",
               "add the answer there or name its column with answer_key", "no ground truth")
        return None
    return _Row(rec, text, answer, raw=isinstance(prompt, str))


def _apply_budget(rows: list[_Row], budget: PromptBudget, tokenizer: Any,
                  reject: Callable[[_Record, str, str], None], skipped: Counter[str]) -> list[_Row]:
    """The rows within ``budget`` after it handles the longer ones: bad rows (``reject``: an
    error naming the row, or dropped under on_bad_row: skip), dropped and counted in ``skipped``
    (``filter``, whatever on_bad_row says, as verl's filter_overlong_prompts), or cut (``left`` /
    ``right``; the text then says what the model sees, for the logged samples)."""
    kept = []
    for row in rows:
        if len(row.ids) <= budget.tokens:
            kept.append(row)
        elif budget.overlong == "filter":
            skipped[f"over {budget.name} (filter_overlong_prompts)"] += 1
        elif budget.overlong == "error":
            reject(row.record, f"has {len(row.ids)} tokens > {budget.name}", f"over {budget.name}")
        else:
            row.ids = budget.fit(row.ids)
            row.text = tokenizer.decode(row.ids)
            kept.append(row)
    return kept


def _prompt_type_problem(prompt: Any) -> str:
    """Why a present prompt value cannot be a prompt ("" when it can, or is just missing)."""
    if prompt is None or isinstance(prompt, str):
        return ""
    if isinstance(prompt, list):
        if all(isinstance(m, dict) and "content" in m for m in prompt):
            return ""
        return "is a list but not of chat messages (each a mapping with `role` and `content`)"
    return f"is {type(prompt).__name__} {_clip(repr(prompt))}, expected a string or a list of chat messages"


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _no_rows_message(source: str, read: int, skipped: Counter[str]) -> str:
    if read == 0:
        what = "it has no rows"
        fix = "point the source at a file with at least one prompt row"
    else:
        reasons = ", ".join(f"{n} {why}" for why, n in skipped.most_common())
        what = f"all {read} rows read were skipped as bad rows ({reasons})"
        fix = "fix those rows (set on_bad_row: error to see the first one named) or use another file"
    return f"{source}: no usable prompts: {what}; a run needs at least one\n    fix: {fix}"


def _builtin_records(source: str, split: str, seed: int, options: dict[str, Any]) -> list[_Record]:
    if source not in BUILTIN_TASKS:
        raise DataError(f"unknown builtin data source '{source}'; builtins: {', '.join(BUILTIN_TASKS)}")
    task_class, allowed, as_prompt = BUILTIN_TASKS[source]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise DataError(f"{source}: unknown options {unknown}; allowed: {list(allowed)}")
    task = task_class(seed=seed, **options)
    return [
        _Record(p.index, f"problem {p.index}", {"prompt": as_prompt(p.prompt), "ground_truth": p.answer,
                                       "extra_info": {"index": p.index}})
        for p in task.problems(split)
    ]


def _gym_records(source: str, seed: int, size: int | None, config: dict[str, Any], options: dict[str, Any],
                 avoid: set[str], report: Callable[[str], None] | None) -> list[_Record]:
    name = reasoning_gym.gym_name(source)
    rows, dropped = reasoning_gym.records(name, config, seed=seed, size=size or reasoning_gym.DEFAULT_SIZE,
                                          options=options, avoid=avoid)
    if dropped and not rows:
        raise DataError(f"{source}: every one of its {dropped} items repeats a train item (the task has few "
                        "distinct items under this config)\n    fix: widen the config, or give the train "
                        "split fewer items")
    if dropped and report is not None:
        report(f"{source}: dropped {dropped} item(s) a train item equals (a small task repeats items "
               "under other seeds)")
    return [_Record(i, f"item {i} (seed {seed} + {i})", fields) for i, fields in rows]


ParquetReader = Callable[["Path | list[Path]"], pa.Table]
#: What a prompt source can be (the fix of an error about one).
SOURCE_KINDS = ("a .parquet file or a folder of them, a .json/.jsonl file, builtin:NAME, reasoning_gym:NAME or "
                "verifiers:ENV_ID")


def missing_prompt_file(path: Path) -> DataError:
    return DataError(f"prompt file {path} does not exist (resolved: {path.resolve()})\n    fix: point "
                     f"data.train.source / data.val.source (or eval --source) at {SOURCE_KINDS} (a path is "
                     "relative to where you run)")


def _file_records(path: Path, read_parquet: ParquetReader | None = None) -> list[_Record]:
    if path.is_dir():
        return _parquet_records(path, _parquet_shards(path), read_parquet)
    if not path.is_file():
        raise missing_prompt_file(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_records(path, path, read_parquet)
    if suffix == ".json":
        data = _parse_json(path, _read_text(path), "file")
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json prompt file must hold a list of records")
        return [_Record(i, f"record {i}", _as_record(path, r, f"record {i}")) for i, r in enumerate(data)]
    if suffix == ".jsonl":
        out = []
        for n, line in enumerate(_read_text(path).splitlines(), start=1):
            if line.strip():
                record = _as_record(path, _parse_json(path, line, f"line {n}"), f"line {n}")
                out.append(_Record(n, f"line {n}", record))
        return out
    raise DataError(f"{path}: unsupported prompt file type '{suffix}'; use one of {FILE_SUFFIXES}")


def _parquet_shards(folder: Path) -> list[Path]:
    """A folder source: its ``*.parquet`` files, read in name order (shard-00000, ...)."""
    shards = sorted(p for p in folder.glob("*.parquet") if p.is_file())
    if not shards:
        raise DataError(f"prompt folder {folder} holds no .parquet files; give a folder of parquet "
                        "shards or a .parquet / .jsonl / .json file")
    return shards


def _parquet_records(path: Path, files: "Path | list[Path]", read_parquet: ParquetReader | None) -> list[_Record]:
    try:
        table = (read_parquet or _read_parquet_files)(files)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure on user data is a bad file
        raise DataError(f"{path}: cannot read as parquet: {_first_line(exc)}\n    fix: rewrite the "
                        "file (is it truncated, or not parquet?); shards in a folder need the same columns") from None
    return [_Record(i, f"row {i}", r) for i, r in enumerate(table.to_pylist())]


def _read_parquet_files(files: "Path | list[Path]") -> pa.Table:
    import pyarrow.parquet as pq

    if isinstance(files, Path):
        return pq.read_table(files)
    return pa.concat_tables([pq.read_table(f) for f in files])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; other encodings are a DataError naming the line and byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start})\n    fix: save the file as UTF-8") from None


def _parse_json(path: Path, text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: {where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # json recurses once per level of nesting
        raise DataError(f"{path}: {where}: JSON nested too deeply to read (lists or objects inside "
                        "each other, thousands of levels)") from None


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
