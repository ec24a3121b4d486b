"""Custom operators used by tests/graphs_bad/*.yaml; each is wrong in one way (or used
wrongly) so the compiler has something to catch."""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from dapo_flow.core import columns as C


class NoParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StringAdvantage:
    """Emits `advantage` as a string, where `update` needs float."""

    Params = NoParams
    REQUIRES = C.typed(C.PROMPT_ID)
    PRODUCES = {C.ADVANTAGE: pa.string()}
    CARDINALITY = "map"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        self.params = params

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch


class DropLong:
    """A row-level filter: drops single samples, so it breaks prompt groups."""

    Params = NoParams
    REQUIRES = C.typed(C.RESPONSE_LEN)
    PRODUCES: dict[str, pa.DataType] = {}
    CARDINALITY = "filter"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        self.params = params

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch


class TagString:
    """Adds a `tag` column as string."""

    Params = NoParams
    REQUIRES: dict[str, pa.DataType] = {}
    PRODUCES = {"tag": pa.string()}
    CARDINALITY = "map"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        self.params = params

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch


class TagInt:
    """Adds a `tag` column as int32 (conflicts with TagString when joined)."""

    Params = NoParams
    REQUIRES: dict[str, pa.DataType] = {}
    PRODUCES = {"tag": pa.int32()}
    CARDINALITY = "map"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        self.params = params

    def __call__(self, batch: pa.Table) -> pa.Table:
        return batch


class NotAnOp:
    """No Params, no CARDINALITY, no columns: fails the operator contract."""

    def run(self, batch):
        return batch
