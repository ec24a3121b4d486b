"""group_codes: the operators' Arrow-side factorization agrees with algos.factorize."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.algos import AlgoError, factorize
from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import group_codes


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal ids <=> equal codes in both: a bijection between the two code sets."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


@pytest.mark.parametrize("type_", [pa.string(), pa.large_string()])
def test_group_codes_of_chunked_sliced_strings(type_):
    rng = np.random.default_rng(0)
    ids = [f"uid-{i}" for i in rng.integers(0, 40, 300)] + ["", "ü-ß", ""]
    col = pa.chunked_array([pa.array(ids[:100], type_), pa.array(ids[100:], type_)])
    g = group_codes(col)
    assert g.codes.dtype == np.int64 and g.n_groups == len(set(ids))
    assert sorted(set(g.codes.tolist())) == list(range(g.n_groups))  # dense
    assert _same_partition(g.codes, factorize(ids).codes)
    sliced = pa.array(ids, type_).slice(7, 200)  # an offset into the buffers
    assert _same_partition(group_codes(sliced).codes, factorize(ids[7:207]).codes)


def test_group_codes_of_other_types_and_edge_cases():
    ints = pa.chunked_array([pa.array([5, 5, 9]), pa.array([1, 9])])
    assert _same_partition(group_codes(ints).codes, np.array([0, 0, 1, 2, 1]))
    empty = group_codes(pa.chunked_array([], type=pa.string()))
    assert empty.n_groups == 0 and empty.codes.shape == (0,)
    with pytest.raises(AlgoError, match="null"):
        group_codes(pa.array(["a", None]))


def test_routes_round_trip_through_their_column_also_from_a_slice():
    from dapo_flow.data.arrow_utils import routes_from_arrow, routes_to_arrow

    routes = [np.arange(4 * (i + 1), dtype=np.int16).reshape(-1, 2, 2) + 10 * i for i in range(5)]
    column = routes_to_arrow(routes)
    assert column.type == C.SCHEMA[C.ROUTED_EXPERTS]
    assert column.to_pylist()[1] == routes[1].reshape(-1).tolist()  # (token, layer, k) order
    # a training group's worker gets a slice of the rows: its offsets still find their values
    back = routes_from_arrow(pa.table({C.ROUTED_EXPERTS: column}).slice(2, 2).column(C.ROUTED_EXPERTS), 2, 2)
    assert [b.tolist() for b in back] == [r.tolist() for r in routes[2:4]]
