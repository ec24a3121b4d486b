"""Roles, not names: outside dapo_flow/operators/ nothing compares an op name with a built-in operator's
name (the compiler, checks and runtime read ``ROLE``), and every operator declares a known role."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dapo_flow.core.contract import ROLES, contract_problems, role
from dapo_flow.graph.registry import OPERATORS

ROOT = Path(__file__).resolve().parents[1]


def _is_op_name(node: ast.AST) -> bool:
    """`x.op`, `op` or `x.op_name`-like expressions that hold a node's op name."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("op", "op_name")
    return isinstance(node, ast.Name) and node.id in ("op", "op_name")


def _builtin_names(node: ast.AST) -> set[str]:
    """Built-in operator names in a string constant or a literal tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(OPERATORS)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_builtin_names(e) for e in node.elts)) if node.elts else set()
    return set()


def _name_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(_is_op_name(s) for s in sides):
            names = set().union(*(_builtin_names(s) for s in sides))
            if names:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.append(f"{where}:{node.lineno} compares an op name with {sorted(names)}")
    return found


def _outside_operators() -> list[Path]:
    """The package's files but the operators' own (which may name themselves)."""
    ops = ROOT / "dapo_flow" / "operators"
    return [f for f in sorted((ROOT / "dapo_flow").rglob("*.py")) if ops not in f.parents]


def test_no_op_name_comparisons_outside_operators():
    files = _outside_operators()
    found = [hit for f in files for hit in _name_comparisons(f)]
    assert not found, "read the operator's ROLE instead:\n" + "\n".join(found)


def test_the_scan_finds_a_name_comparison(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text('def f(node):\n    return node.op == "generate" or node.op in ("update", "x")\n')
    assert len(_name_comparisons(bad)) == 2


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_every_builtin_declares_a_known_role(name):
    cls = OPERATORS[name]
    assert "ROLE" in vars(cls) and role(cls) in ROLES
    assert contract_problems(cls) == []


def test_an_unknown_or_modelless_role_is_a_contract_problem():
    from dapo_flow.operators.overlong_shape import OverlongShape

    odd = type("Odd", (OverlongShape,), {"ROLE": "judge"})
    assert any("`ROLE` must be one of" in p for p in contract_problems(odd))
    cpu_trainer = type("CpuTrainer", (OverlongShape,), {"ROLE": "train"})
    assert any("set `NEEDS_MODEL = True`" in p for p in contract_problems(cpu_trainer))
    assert role(type("Plain", (), {})) == "transform"


def test_a_scope_is_declared_read_from_params_or_batch_and_an_unknown_one_is_a_problem():
    from dapo_flow.core.contract import scope_of
    from dapo_flow.operators.advantage import Advantage
    from dapo_flow.operators.advantage import Params as AdvParams
    from dapo_flow.operators.overlong_shape import OverlongShape

    assert scope_of(OverlongShape, None) == "row"
    assert scope_of(OPERATORS["group-filter"], None) == "batch"  # says nothing: nothing split off it
    assert scope_of(Advantage, AdvParams(estimator="grpo")) == "group"
    assert scope_of(Advantage, AdvParams(estimator="reinforce_pp_baseline")) == "batch"  # whitened
    assert scope_of(Advantage, AdvParams(estimator="grpo", distill_coef=1.0)) == "batch"  # per token
    odd = type("Odd", (OverlongShape,), {"SCOPE": "rows"})
    assert any("`SCOPE` must be one of row, group, batch" in p for p in contract_problems(odd))


#: what an operator class declares (contract.py's docstring): read through contract_of only
DECLARED = {"ROLE", "CARDINALITY", "NEEDS_MODEL", "REQUIRES", "PRODUCES", "MODEL_HEAD", "MODEL_PARAM", "INPUTS",
            "SCOPE"}
HOOKS = {"upstream_problems", "uses_model", "model_head", "combine", "input_requires", "last_metrics",
         "sampling_settings", "train_sizing", "forward_rows", "group_settings", "logprob_role", "scope"}


def _contract_probes(path: Path) -> list[str]:
    """`cls.ROLE`-like reads and getattr / hasattr probes of the contract's names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in DECLARED and isinstance(node.ctx, ast.Load):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in DECLARED | HOOKS):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_compiler_and_runtime_read_operators_through_their_contract_only():
    files = _outside_operators()
    found = [hit for f in files if f.name != "contract.py" for hit in _contract_probes(f)]
    assert not found, "read contract_of(op_cls) instead:\n" + "\n".join(found)


def test_a_contract_holds_the_declarations_and_the_defaults():
    from dapo_flow.core.contract import contract_of

    update, score, baseline = (contract_of(OPERATORS[n]) for n in ("update", "score", "baseline"))
    assert (update.role, update.cardinality, update.needs_model, update.stateful) == ("train", "sink", True, True)
    assert update.requires_fn is not None and update.combine is None and update.model_head_static == "lm"
    assert score.model_param == ("reward", "model") and score.closes and score.role == "reward"
    assert baseline.combine is not None and baseline.input_requires is not None and baseline.inputs_hint

    class Minimal:  # nothing optional declared: the defaults
        Params = None
        CARDINALITY = "map"
        NEEDS_MODEL = False
        REQUIRES: dict = {}
        PRODUCES: dict = {}

        def __call__(self, batch):
            return batch

    bare = contract_of(Minimal)
    assert (bare.role, bare.model_head_static, bare.model_param, bare.stateful, bare.reports_metrics) == (
        "transform", "lm", (), False, False)


def test_the_compiler_reads_a_roles_settings_through_its_declared_hook():
    """graph/ sizes and checks generate and train nodes by what their op declares (Sampling,
    TrainSizing), never by a param's name; an op declaring neither the hook nor a param of the
    built-in names is a contract problem instead of a node sized by defaults without a word."""
    from pydantic import BaseModel, ConfigDict

    from dapo_flow.core.contract import (GroupSettings, LOGPROB_ROLE_PARAM, ROLE_SETTINGS, Sampling, logprob_role_of,
                                         sampling_of, train_sizing_of)

    names = ({n for _, fields in ROLE_SETTINGS.values() for n in fields} | set(GroupSettings.__dataclass_fields__)
             | {LOGPROB_ROLE_PARAM, "format"})
    probes = [f"{f.relative_to(ROOT)}:{node.lineno}" for d in ("graph", "runtime")
              for f in sorted((ROOT / "dapo_flow" / d).rglob("*.py")) for node in ast.walk(ast.parse(f.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names]
    assert not probes, "read node.sampling() / node.train_sizing() / node.logprob_role() instead:\n" + "\n".join(probes)

    generate, update = OPERATORS["generate"], OPERATORS["update"]
    assert sampling_of(generate, generate.Params(n=4, max_tokens=12)) == Sampling(n=4, max_tokens=12)
    assert sampling_of(generate, generate.Params(n=4, temperature=0.0)).greedy
    agent = OPERATORS["agent-generate"]
    assert sampling_of(agent, agent.Params(format="compact")).call_format == "compact"
    logprob, values = OPERATORS["logprob"], OPERATORS["values"]
    assert logprob_role_of(logprob, logprob.Params(role="teacher")) == "teacher"
    assert logprob_role_of(values, values.Params()) == "actor"  # no hook, no `role` param: the default
    sizing = train_sizing_of(update, update.Params(mini_batches=2, entropy_coef=0.01))
    assert (sizing.mini_batches, sizing.entropy_in_loss) == (2, True)

    class Knobs(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        samples: int = 3

    class OddGenerate:  # its group size under another name, no hook
        Params = Knobs
        REQUIRES = generate.REQUIRES
        PRODUCES = generate.PRODUCES
        CARDINALITY = "expand"
        NEEDS_MODEL = True
        ROLE = "generate"

        def __call__(self, batch):
            return batch

    assert any("sampling_settings(params)" in p for p in contract_problems(OddGenerate))
    declared = type("DeclaredGenerate", (), {**vars(OddGenerate), "sampling_settings": classmethod(
        lambda cls, params: Sampling(n=params.samples))})
    assert contract_problems(declared) == []
    assert sampling_of(declared, Knobs()).n == 3
