"""A run's prompts: the generating model's tokenizer, each data source read under the graph's
prompt budget (a mixture's sources one by one), and the sampler that draws each step's prompts
from them (a seeded permutation, a mixture's stratified draw, or a stream's shuffle buffer)."""

from __future__ import annotations

import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.runtime.sampler import PromptSampler

def generator_dir(plan):
    """The directory of the model the plan generates with (else its first model); resolving
    the models first builds a builtin one, with its progress bar here in the driver, before any
    actor asks for it."""
    from dapo_flow.models import resolve_model

    spec = plan.spec
    generator = plan.first("generate")
    model_name = generator.model if generator is not None and generator.model else next(iter(spec.models))
    for model in spec.models.values():
        resolve_model(model.path)
    return resolve_model(spec.models[model_name].path)


def generator_tokenizer(plan):
    """The tokenizer of :func:`generator_dir`'s model."""
    from dapo_flow.core.imports import skip_unneeded_transformers_imports

    skip_unneeded_transformers_imports()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(generator_dir(plan)))


def load_source(plan, src, tokenizer, read_parquet=None, report=None, role: str = "train"):
    """One data source's prompts as an Arrow table, plus the count of dropped rows (bad rows
    skipped, prompts over the budget filtered). Prompts are held to the graph's prompt budget,
    else to the room the generating model's context leaves beside max_tokens. A mixture's
    sources are read one by one (:func:`load_parts`) and concatenated."""
    parts = load_parts(plan, src, tokenizer, read_parquet, report, role)
    return pa.concat_tables([t for t, _ in parts]), sum(n for _, n in parts)


def load_parts(plan, src, tokenizer, read_parquet=None, report=None, role: str = "train"):
    """(prompts, dropped rows) of each single source of ``src`` (``role``: train or val, which
    picks a generated source's default seed). A mixture's prompt ids are prefixed with the
    source's position, so that two sources' rows never share a group. A validation gym source
    leaves out the items a train source of the same task and config holds."""
    from dapo_flow.data import reasoning_gym as gym
    from dapo_flow.data.arrow_utils import with_columns
    from dapo_flow.data.prompts import load_prompts
    from dapo_flow.graph.data_checks import leaves, source_seed

    spec, out = plan.spec, []
    for k, leaf in enumerate(src.leaves()):
        avoid: set[str] = set()
        if role == "val" and gym.is_gym(leaf.source):
            for r, _, train in leaves(spec.data):
                if r == "train" and train.source == leaf.source and train.config == leaf.config:
                    avoid |= gym.questions(gym.gym_name(leaf.source), train.config,
                                           seed=source_seed(train, r, spec.seed), size=train.size or gym.DEFAULT_SIZE)
        table, dropped = load_prompts(
            leaf.source, tokenizer=tokenizer, split=leaf.split, size=leaf.size, seed=source_seed(leaf, role, spec.seed),
            options=dict(leaf.options), config=dict(leaf.config), avoid=avoid, prompt_key=leaf.prompt_key,
            answer_key=leaf.answer_key, on_bad_row=leaf.on_bad_row, budget=plan.prompt_budget(src),
            read_parquet=read_parquet, report=report,
        )
        if src.sources is not None:
            table = with_columns(table, {C.PROMPT_ID: [f"{k}/{i}" for i in table.column(C.PROMPT_ID).to_pylist()]})
        out.append((table, dropped))
    return out


def load_run_data(plan, tokenizer, read_parquet=None, report=None):
    """(train prompts, val prompts, dropped rows); train prompts are None for a streamed source
    (:func:`train_sampler` reads it as the run goes), and a list of tables, one per source, for a
    mixture."""
    data = plan.spec.data
    if data.train.stream:
        train, skipped = None, 0
    else:
        parts = load_parts(plan, data.train, tokenizer, read_parquet, report)
        train = [t for t, _ in parts] if data.train.sources is not None else parts[0][0]
        skipped = sum(n for _, n in parts)
    val, val_skipped = (load_source(plan, data.val, tokenizer, read_parquet, report, role="val")
                        if data.val is not None else (None, 0))
    return train, val, skipped + val_skipped


def train_sampler(plan, train_prompts, ex):
    """The training prompts' sampler: a seeded permutation per epoch of a table read whole, a
    stratified draw over a mixture's tables (:class:`~dapo_flow.runtime.mixture.MixtureSampler`),
    or a shuffle buffer over a streamed source (:func:`prompt_stream`)."""
    spec = plan.spec
    src = spec.data.train
    if src.sources is not None:
        from dapo_flow.runtime.mixture import MixtureSampler

        return MixtureSampler(train_prompts, src.shares(), spec.seed)
    if not src.stream:
        return PromptSampler(train_prompts, spec.seed)
    from dapo_flow.data.stream import StreamSampler

    return StreamSampler(prompt_stream(plan, src, ex), spec.seed, src.shuffle_buffer, src.split, src.source,
                         src.size)


def prompt_stream(plan, src, ex):
    """``open()`` -> one pass over a parquet source's tokenized batches (:class:`~dapo_flow.data.
    stream.TokenizeBatch` outputs, in source order): read and tokenized by streaming Ray tasks
    under Ray, else here batch by batch."""
    from dapo_flow.data.stream import stream_files, tokenized_batches

    files = stream_files(src.source)
    tokenize = tokenize_batch(plan, src)
    if ex.stream_parquet is not None:
        return lambda: ex.stream_parquet(files, tokenize)
    return lambda: (b for f in files for b in tokenized_batches(str(f), tokenize))


def tokenize_batch(plan, src):
    """The :class:`~dapo_flow.data.stream.TokenizeBatch` of a streamed source: its bad-row
    handling and the graph's prompt budget, with the generator's tokenizer."""
    from dapo_flow.data.stream import TokenizeBatch

    return TokenizeBatch(str(generator_dir(plan)), src.source, src.split, src.prompt_key, src.answer_key,
                         on_bad_row=src.on_bad_row, budget=plan.prompt_budget(src))
