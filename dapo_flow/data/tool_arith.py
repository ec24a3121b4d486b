"""``builtin:tool-arith``: two-digit multiplication, hard in a tiny model's head, easy with a calculator.

A prompt is ``a*b=`` (a, b in [10, 99] by default; options low/high/train_size/val_size as
``builtin:addition``, disjoint seeded splits). The agent loop lets the model call a calculator
in the compact tool-call format (``dapo_flow.tools.calls.Compact``); a tool-using response is
two model turns around one observation the loop appends (never trained on)::

    12*34=  ->  <call>calculator: 12*34</call></s>     model turn 1 (then EOS)
                <result>408</result>                   observation (loss mask 0)
                408</s>                                model turn 2

A direct response is the product alone, ``408</s>``. ``verify_tool_arith`` reads the final
answer (after the last ``</result>``, else the whole response) and wants it exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_flow.data.tasks import Problem, check_pair_options, pair_split

TOOL_ARITH = "builtin:tool-arith"
TOOL_ARITH_OPTIONS = ("low", "high", "train_size", "val_size")
CALCULATOR = "calculator"  # the built-in tool's name (dapo_flow.tools; not imported: data stays light)
RESULT_CLOSE = "</result>"
# the char tokenizer's special tokens (models/tokenizer.py; not imported: it loads transformers):
# a response decoded with them kept reads the same
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


@dataclass(frozen=True)
class ToolArithTask:
    """``a*b=`` for a, b in [low, high]; val pairs are drawn first so they never reach train."""

    low: int = 10
    high: int = 99
    train_size: int | None = None  # None: every pair not in val
    val_size: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        check_pair_options(TOOL_ARITH, self)

    def problems(self, split: str) -> list[Problem]:
        """The split's problems in a fixed, seeded order."""
        return [Problem(prompt=f"{a}*{b}=", answer=str(a * b), index=i)
                for i, (a, b) in enumerate(pair_split(TOOL_ARITH, self, split))]


def operands(prompt: str) -> tuple[int, int]:
    """``"12*34="`` -> (12, 34)."""
    a, b = prompt.rstrip("=").split("*")
    return int(a), int(b)


def call_text(prompt: str) -> str:
    """Model turn 1 of a tool-using response to ``prompt``: ``<call>calculator: a*b</call>``."""
    a, b = operands(prompt)
    return f"<call>{CALCULATOR}: {a}*{b}</call>"


def observation_text(result: str) -> str:
    """What the loop appends after a call: ``<result>P</result>``."""
    return f"<result>{result}{RESULT_CLOSE}"


def final_answer(response_text: str) -> str:
    """The text after the last ``</result>`` if there is one, else the whole response; special
    tokens removed, whitespace stripped."""
    for special in _SPECIALS:
        response_text = response_text.replace(special, "")
    return response_text.rpartition(RESULT_CLOSE)[2].strip()


def verify_tool_arith(response_text: str, ground_truth: str, *, correct: float = 1.0,
                      wrong: float = -1.0) -> float:
    """``correct`` iff the final answer (:func:`final_answer`) is exactly the ground truth; an
    empty final answer (a response ending at a call or an observation) is wrong."""
    answer = final_answer(response_text)
    return correct if answer and answer == ground_truth.strip() else wrong
