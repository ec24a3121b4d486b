"""`dapo-flow ops` reads each param's docstring through pydantic (use_attribute_docstrings)."""

from __future__ import annotations

import io

from rich.console import Console

from dapo_flow.graph.catalog import print_catalog
from dapo_flow.core.contract import PARAMS_CONFIG
from dapo_flow.graph.registry import CUSTOM_OP, OPERATORS


def test_every_builtin_param_is_documented():
    undocumented = [f"{name}.{field}" for name, cls in OPERATORS.items()
                    for field, info in cls.Params.model_fields.items() if not info.description]
    assert undocumented == []
    assert all(cls.Params.model_config == PARAMS_CONFIG for cls in OPERATORS.values())


def test_the_catalog_prints_columns_params_and_docs():
    buf = io.StringIO()
    print_catalog(OPERATORS, CUSTOM_OP, Console(file=buf, width=200, highlight=False))
    text = buf.getvalue()
    update = text.split("\nupdate ", 1)[1].split("\n\n", 1)[0]
    assert "max_nonfinite_steps: int = 3" in update
    assert "loss_agg_mode: 'token-mean' | 'token-sum'" in update
    assert "clip_c: float | None = 10.0  [> 1.0]" in update
    assert text.rstrip().endswith("(see dapo_flow/core/contract.py)")
    generate = ("\n" + text).split("\ngenerate ", 1)[1].split("\n\n", 1)[0]  # the first op listed
    assert "out routed_experts: list<int16>  (when its model has train.routing_replay)" in generate
