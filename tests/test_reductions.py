"""A metric's reduction travels with its value (dapo_flow.reductions): over a step's calls in the
driver (MetricAccumulator), over a training group's workers (join_reports), through pickling
(Ray) and into MLflow / JSON as a plain float."""

from __future__ import annotations

import json
import pickle

import pytest

from dapo_flow.reductions import Max, Min, Rate, Seconds, Total, kind_of, over_calls, over_workers
from dapo_flow.runtime.group import join_reports
from dapo_flow.runtime.metrics import MetricAccumulator


def test_each_kind_adds_up_over_calls():
    acc = MetricAccumulator()
    for tokens, seconds, rate, longest, shortest, loss in [(10, 1.0, 10.0, 7, 2, 0.5), (30, 2.0, 15.0, 9, 1, 1.5)]:
        acc.add({"gen/tokens": Total(tokens), "gen/seconds": Seconds(seconds), "gen/tokens_per_s": Rate(rate),
                 "len_max": Max(longest), "len_min": Min(shortest), "loss": loss})
    out = acc.result()
    assert out == {"gen/tokens": 40.0, "gen/seconds": 3.0, "gen/tokens_per_s": 12.5, "len_max": 9.0,
                   "len_min": 1.0, "loss": 1.0}
    assert type(out["gen/tokens"]) is Total and type(out["loss"]) is float  # the kind stays for the next sum


def test_each_kind_adds_up_over_a_groups_workers():
    """Two workers, the first with 3 rows, the second with 1: times the slowest, counts and
    throughputs added, extremes as such, a plain float weighted by rows."""
    reports = [[("gen", {"t": Seconds(2.0), "n": Total(6), "r": Rate(5.0), "hi": Max(4), "lo": Min(1), "m": 1.0}, 2.0)],
               [("gen", {"t": Seconds(3.0), "n": Total(2), "r": Rate(7.0), "hi": Max(9), "lo": Min(0), "m": 5.0}, 3.0)]]
    [(nid, metrics, seconds)] = join_reports(reports, [3, 1])
    assert (nid, seconds) == ("gen", 3.0)
    assert metrics == {"t": 3.0, "n": 8.0, "r": 12.0, "hi": 9.0, "lo": 0.0, "m": 2.0}
    assert all(type(metrics[k]) is type(reports[0][0][1][k]) for k in metrics)


@pytest.mark.parametrize("kind", [Total, Seconds, Rate, Max, Min])
def test_a_kind_survives_pickling_and_reads_as_a_float(kind):
    value = pickle.loads(pickle.dumps(kind(1.5)))
    assert kind_of(value) is kind and value == 1.5
    assert json.loads(json.dumps({"x": value})) == {"x": 1.5}
    assert kind_of(value + 1) is float  # arithmetic gives a plain float: a derived metric averages


def test_a_float_and_an_unknown_subclass_average():
    class Odd(float):
        pass

    assert kind_of(Odd(2.0)) is float and kind_of(3.0) is float
    assert over_calls(float, [1.0, 2.0]) == 1.5 and over_workers(float, [1.0, 3.0], [0, 0]) == 2.0


@pytest.mark.parametrize("rs", ["token_k1", "seq_mean_k3", "token_k1,seq_max_k2"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_extreme_the_rollout_correction_math_names_declares_it(rs, level):
    """A metric named *_max / *_min by algos.rollout_correction is a Max / Min, so a training
    group's join takes the extreme over its workers (as a name suffix used to decide)."""
    import torch

    from dapo_flow import algos

    torch.manual_seed(0)
    log_ratio, mask = torch.randn(4, 6) * 0.3, torch.ones(4, 6)
    mask[1, 4:] = 0
    _, is_metrics = algos.rollout_correction_weights(log_ratio, mask, level, 2.0)
    _, rs_metrics = algos.rollout_rejection_mask(log_ratio, mask, rs, 10.0)
    named = {**is_metrics, **rs_metrics}
    extremes = {k: v for k, v in named.items() if k.endswith(("_max", "_min"))}
    assert extremes, named
    for key, value in extremes.items():
        assert kind_of(value) is (Max if key.endswith("_max") else Min), key


def test_the_staleness_histogram_of_a_batch_split_over_a_group():
    """Each worker counts its share's tokens per policy version (counts, added over the group);
    the driver turns them into the fraction of tokens 0, 1, ... versions behind the trainer."""
    import pyarrow as pa

    from dapo_flow.runtime.loop import token_staleness
    from dapo_flow.runtime.metrics import version_stats

    rank0 = version_stats(pa.chunked_array([pa.array([[4, 4, 5], [5]], pa.list_(pa.int32()))]))
    rank1 = version_stats(pa.chunked_array([pa.array([[3, 3], [], [5, 5]], pa.list_(pa.int32()))]))
    (_, joined, _), = join_reports([[("train", rank0, 0.1)], [("train", rank1, 0.1)]], [2, 3])
    assert {k: v for k, v in joined.items() if "tokens_at_version" in k} == {
        "batch/rollout_tokens_at_version_3": 2, "batch/rollout_tokens_at_version_4": 2,
        "batch/rollout_tokens_at_version_5": 4}  # the workers' counts, added
    metrics = dict(joined)
    staleness = token_staleness(metrics, trained_version=5)
    assert staleness == {"batch/rollout_version_min": 3, "batch/rollout_version_mean": 34 / 8,  # the token mean
                         "rollout/token_staleness_max": 2, "rollout/token_staleness_mean": 5 - 34 / 8,
                         "rollout/token_staleness_frac_0": 4 / 8, "rollout/token_staleness_frac_1": 2 / 8,
                         "rollout/token_staleness_frac_2": 2 / 8}
    assert kind_of(staleness["batch/rollout_version_min"]) is Min
    assert not [k for k in metrics if "tokens_at_version" in k]  # taken out: their names grow with the run
    assert token_staleness({"batch/rollout_tokens_at_version_7": Total(3)}, 8) == {
        "batch/rollout_version_min": 7, "batch/rollout_version_mean": 7.0,
        "rollout/token_staleness_max": 1, "rollout/token_staleness_mean": 1.0,
        "rollout/token_staleness_frac_0": 0.0, "rollout/token_staleness_frac_1": 1.0}
    assert token_staleness({"batch/reward_mean": 0.5}, 8) == {}  # no rollout_version column: nothing


def test_a_value_every_worker_reduced_alike_is_kept_to_the_bit():
    """A training group's update reduces its metrics over the group itself (each worker holds
    the same row): joined by row weights, 0.123456789 would come back 0.12345678899999998."""
    assert over_workers(float, [0.123456789] * 2, [3, 7]) == 0.123456789
    assert over_workers(float, [1.0, 2.0], [1, 3]) == 1.75  # different values: the weighted mean
    assert over_workers(Total, [2.0, 2.0], [1, 1]) == 4.0  # counts still add
