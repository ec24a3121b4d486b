"""builtin:tiny-adder: accuracy band, reproducible bytes, caching; resolve_model errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dapo_flow.models as models
from dapo_flow.errors import ModelError
from dapo_flow.home import dapo_flow_home
from dapo_flow.models import build_builtin, resolve_model
from dapo_flow.recipes.tiny_adder import BUILD_INFO, RECIPE_VERSION, build_tiny_adder
from dapo_flow.data.tasks import AdditionTask, verify_addition

BAND = (0.20, 0.50)  # RL needs groups with both right and wrong samples


def test_model_dir_contents(tiny_adder_path: Path):
    names = {p.name for p in tiny_adder_path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", BUILD_INFO} <= names
    assert tiny_adder_path.name == f"tiny-adder-v{RECIPE_VERSION}"
    config = json.loads((tiny_adder_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64)  # vLLM CPU head sizes


def test_declared_shape_is_the_built_config(tiny_adder_path: Path):
    """explain estimates memory from the declared shape before anything is built."""
    built = json.loads((tiny_adder_path / "config.json").read_text())
    declared = models.model_config("builtin:tiny-adder")
    assert declared == {k: built[k] for k in declared}


def test_recorded_sampled_accuracy_in_band(tiny_adder_path: Path):
    info = json.loads((tiny_adder_path / BUILD_INFO).read_text())
    assert info["recipe_version"] == RECIPE_VERSION
    assert BAND[0] <= info["val_sampled_accuracy"] <= BAND[1]


def test_remeasured_sampled_accuracy_in_band(tiny_adder_path: Path):
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    policy = HFPolicy(tiny_adder_path)
    val = AdditionTask().problems("val")
    prompts = policy.tokenizer([p.prompt for p in val])["input_ids"]
    out = policy.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_tokens=6, seed=99))
    texts = policy.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    acc = sum(verify_addition(t, val[i].answer) > 0 for t, i in zip(texts, out.prompt_index)) / len(texts)
    assert BAND[0] <= acc <= BAND[1]


def test_a_short_recipe_build_is_byte_reproducible(tmp_path: Path):
    """The build code is deterministic: two builds of a few-step recipe are equal byte for byte.
    The shipped recipe runs the same code for more steps; that its build on this machine is the
    one the documented figures came from, the figure tests show (test_learning: the main job's
    figures to the printed digit), so a second full build (~1 min) would add nothing."""
    import dataclasses

    from dapo_flow.recipes import tiny_adder

    short = dataclasses.replace(tiny_adder.RECIPE, steps=20, eval_samples_per_prompt=1)
    a, b = (build_tiny_adder(tmp_path / name, progress=False, recipe=short) for name in ("a", "b"))
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    info = json.loads((a / BUILD_INFO).read_text())
    assert info["recipe"]["steps"] == 20 and info["val_sampled_accuracy"] == json.loads(
        (b / BUILD_INFO).read_text())["val_sampled_accuracy"]


def test_home_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DAPO_FLOW_HOME", raising=False)
    assert dapo_flow_home() == Path.home() / ".cache" / "dapo-flow"
    monkeypatch.setenv("DAPO_FLOW_HOME", str(tmp_path))
    assert dapo_flow_home() == tmp_path


@pytest.fixture()
def fake_builtin(monkeypatch, tmp_path):
    """A fast stand-in builder under a temporary DAPO_FLOW_HOME; records its calls."""
    monkeypatch.setenv("DAPO_FLOW_HOME", str(tmp_path))
    calls: list[Path] = []

    class FakeBuiltin:
        def build(self, out: Path, progress: bool) -> Path:
            calls.append(out)
            (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "n": len(calls)}))
            if len(calls) == 3:
                raise RuntimeError("boom")
            return out

        def version(self) -> int:
            return 7

    monkeypatch.setitem(models.BUILTINS, "fake", FakeBuiltin())
    return calls


def test_builtin_built_once_then_cached(fake_builtin, tmp_path):
    path = resolve_model("builtin:fake", progress=False)
    assert path == tmp_path / "models" / "fake-v7"
    assert resolve_model("builtin:fake") == path and len(fake_builtin) == 1
    assert fake_builtin[0].parent == path.parent and fake_builtin[0] != path  # built beside, renamed in
    rebuilt = build_builtin("fake", force=True, progress=False)
    assert json.loads((rebuilt / "config.json").read_text())["n"] == 2
    with pytest.raises(RuntimeError, match="boom"):  # a failed build keeps the old one, no leftovers
        build_builtin("fake", force=True, progress=False)
    assert json.loads((path / "config.json").read_text())["n"] == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-v7", "fake-v7.lock"]


def write_config(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "config, match",
    [
        ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "describes BertForMaskedLM, not a causal LM"),
        ({"model_type": "t5"}, "describes model_type 't5', not a causal LM"),
        ({}, "names neither `architectures` nor `model_type`"),
    ],
)
def test_resolve_rejects_non_causal_lm(tmp_path, config, match):
    with pytest.raises(ModelError, match=match) as err:
        resolve_model(str(write_config(tmp_path, config)))
    assert "point `path:` at a local Hugging Face model directory" in str(err.value)


@pytest.mark.parametrize("config", [{"architectures": ["GPT2LMHeadModel"]}, {"model_type": "llama"}])
def test_resolve_accepts_causal_lm(tmp_path, config):
    assert resolve_model(str(write_config(tmp_path, config))) == tmp_path.resolve()


def test_resolve_path_errors(tmp_path):
    with pytest.raises(ModelError, match="'/no/such/model' does not exist.*builtin:tiny-adder"):
        resolve_model("/no/such/model")
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ModelError, match="is a file, not a directory"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelError, match="is not valid JSON"):
        resolve_model(str(tmp_path))


def test_unknown_builtin_lists_builtins():
    with pytest.raises(ModelError, match="unknown builtin model 'builtin:huge'; builtins: builtin:tiny-adder"):
        resolve_model("builtin:huge")


def test_importing_models_is_light():
    code = "import sys, dapo_flow.models; print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
