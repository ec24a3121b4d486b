"""AlgoError: bad input to an algorithm function, with the valid choices."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from dapo_flow.errors import DapoFlowError


class AlgoError(DapoFlowError, ValueError):
    """Bad input to an algorithm function (unknown mode, all-masked batch, shape mismatch, ...).

    A DapoFlowError, so a run that reaches one (e.g. an update fed an empty batch) ends with
    the message and exit 2, not a traceback; still a ValueError for callers of the math."""


def bad_choice(what: str, value: object, valid: Sequence[str]) -> AlgoError:
    hint = difflib.get_close_matches(str(value), valid, n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    return AlgoError(f"unknown {what} {value!r}{did_you_mean}; valid: {', '.join(valid)}")
