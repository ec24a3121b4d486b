"""Mistakes a user makes at the command line end in a clear error and exit 2, before anything
is lost or waited on: paths that cannot be read or written, a Ray head or MLflow server that is
not there, a model directory that is incomplete or damaged, an eval that would write over its
own prompts, flags out of range."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_flow import cli
from dapo_flow.errors import DapoFlowError, ModelError, RunError

ROOT = Path(__file__).resolve().parents[2]
DAPO = str(ROOT / "graphs" / "dapo.yaml")


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fails(argv: list[str], capsys) -> str:
    """Run the CLI in this process; it must exit 2 without a traceback. Returns its stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as done:  # argparse's own errors
        code = done.code
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    return err


def test_paths_that_cannot_be_read_or_written_are_named(tmp_path, capsys):
    long_name = tmp_path / ("a" * 300 + ".yaml")  # past the file system's 255 bytes
    assert "cannot read it: File name too long" in _fails(["validate", str(long_name)], capsys)
    # an OSError anywhere under a command: its reason and path, no traceback
    err = _fails(["graph", DAPO, "-o", str(tmp_path / "no" / "such" / "dag.mmd")], capsys)
    assert "No such file or directory: " in err and "dag.mmd" in err and "fix: check that path" in err


def test_a_ray_head_that_is_not_there_is_an_error_at_once(capsys):
    from dapo_flow.runtime.executors import check_head_answers

    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(RunError, match=rf"(?s)no Ray head answers at '{address}' \(Connection refused\).*ray start --head"):
        check_head_answers(address)  # ray.init retried such an address for minutes
    for left_to_ray in ("local", "auto", "ray://somewhere:10001"):
        check_head_answers(left_to_ray)
    err = _fails(["run", DAPO, "--address", address, "--steps", "1"], capsys)
    assert f"no Ray head answers at '{address}'" in err


def test_an_mlflow_server_that_is_not_there_or_a_uri_it_cannot_use(capsys, monkeypatch):
    from dapo_flow.tracking import StoreError, _client

    uri = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(StoreError, match=rf"(?s)the MLflow tracking server at '{uri}' does not answer.*mlflow server"):
        _client(uri)  # MLflow's client retried it with backoff for minutes
    with pytest.raises(StoreError, match=r"(?s)MLflow cannot open the tracking store 'garbage://x'.*fix: set tracking.uri"):
        _client("garbage://x")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert "does not answer" in _fails(["compare", "some-sweep"], capsys)


def test_compare_writes_only_a_png(tmp_path, capsys):
    graph = tmp_path / "dapo.yaml"
    shutil.copy(DAPO, graph)
    for out in (graph, tmp_path):  # a graph file it would have replaced by a PNG; a folder
        assert "the plot is a PNG image: name a .png file" in _fails(["compare", "x", "-o", str(out)], capsys)
    assert graph.read_text() == Path(DAPO).read_text()


def test_an_incomplete_or_damaged_model_directory_is_a_model_error(tmp_path, tiny_adder_path):
    from dapo_flow.models.hf import HFPolicy

    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_adder_path, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"(?s)no-weights: cannot load the model: .*fix: a Hugging Face model directory"):
        HFPolicy(no_weights)
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_adder_path, damaged)
    (damaged / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelError, match=r"damaged: cannot load the model: its weights are damaged"):
        HFPolicy(damaged)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_adder_path, no_tokenizer)
    for f in no_tokenizer.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ModelError, match=r"no-tokenizer: cannot load the tokenizer"):
        HFPolicy(no_tokenizer)


def test_eval_never_writes_over_its_prompts_and_reads_only_parquet(workdir, small_graph):
    from dapo_flow.experiments.evaluate import evaluate
    from dapo_flow.graph.compiler import compile_graph
    from dapo_flow.graph.plan import Cluster

    placed = compile_graph(small_graph(workdir), Cluster(cpus=2))
    prompts = workdir / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["1+2=", "3+4="], "ground_truth": ["3", "7"]}), prompts)
    before = prompts.read_bytes()
    with pytest.raises(RunError, match=r"--save .*prompts.parquet: that is the file the prompts are read from"):
        evaluate(placed, which="base", source=str(prompts), save=str(prompts))
    assert prompts.read_bytes() == before
    (workdir / "out.parquet").mkdir()
    with pytest.raises(RunError, match=r"--save .*out.parquet: that is a folder"):
        evaluate(placed, which="base", save=str(workdir / "out.parquet"))
    not_parquet = workdir / "prompts-2.parquet"
    not_parquet.write_text("a: 1\n")
    with pytest.raises(DapoFlowError, match=r"(?s)prompts-2.parquet: cannot read it as parquet .*fix: --source takes"):
        evaluate(placed, which="base", source=str(not_parquet), n=1)


@pytest.mark.parametrize("argv, says", [
    (["run", DAPO, "--resume", ""], "the run id is empty"),  # an unset $RUN_ID: not a new run
    (["eval", DAPO, "--temperature", "nan"], "must be a number 0-10, got nan"),
    (["eval", DAPO, "--n", "100000000"], "must be a whole number 1-1024"),
    (["sweep", str(ROOT / "graphs" / "ablations" / "dapo-ladder.yaml"), "--dry-run", "--seeds", "0,0"],
     "seed 0 is given twice"),
    (["sweep", str(ROOT / "graphs" / "ablations" / "dapo-ladder.yaml"), "--dry-run", "--seeds", "0,,1"],
     "seeds must be integers"),
    (["sweep", str(ROOT / "graphs" / "ablations" / "dapo-ladder.yaml"), "--dry-run", "--only", ","],
     "no variant named"),
    (["validate", DAPO, "--cpus", "0"], "expected a number > 0, got 0"),
    (["validate", DAPO, "--set", "tracking.experiment=" + "e" * 201], "at most 200 characters"),
    (["validate", DAPO, "--insert", "n" + "x" * 64 + ":logprob:after=adv"], "at most 64 characters"),
])
def test_flags_out_of_range_are_refused(argv, says, capsys):
    assert says in _fails(argv, capsys)


def test_models_build_takes_the_name_as_a_graph_writes_it(tiny_adder_path, capsys):
    assert cli.main(["models", "build", "builtin:tiny-adder"]) == 0  # cached: nothing is built
    assert f"built tiny-adder at {tiny_adder_path}" in capsys.readouterr().out


def test_prompts_tokenized_for_another_model_are_a_model_error(tiny_adder_path):
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    policy = HFPolicy(tiny_adder_path)
    past = policy.model.get_input_embeddings().num_embeddings  # e.g. a chat tokenizer's ids
    with pytest.raises(ModelError, match=rf"a prompt holds token id {past}, past the model's {past}-token vocabulary"):
        policy.generate([[1, 2], [1, past]], SamplingConfig(n=1, max_tokens=2))


def test_ui_on_a_host_that_is_not_this_machine_says_so(capsys):
    err = _fails(["ui", "--host", "nosuchhost.invalid", "--port", str(_closed_port())], capsys)
    assert "cannot serve on nosuchhost.invalid" in err and "fix: --host takes an address of this machine" in err
