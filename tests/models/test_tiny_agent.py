"""builtin:tiny-agent: the demonstrations' token layout (the agent loop's contract), loss masks,
the group-batched fit, the tokenizer, determinism, and the tuned tool-use figures.

The band tests read the cached build (``builtin:tiny-agent``, built once, ~2 min on one core,
into the persistent cache like tiny-adder; slow tier, so the fast tier builds no agent); the
others use a short-recipe build."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from dapo_flow.data.tasks import Problem
from dapo_flow.data.tool_arith import ToolArithTask, verify_tool_arith
from dapo_flow.models import model_config, resolve_model
from dapo_flow.recipes import tiny_agent
from dapo_flow.recipes.warm_start import deterministic_torch, group_weights, supervised_labels

# tuned bands: RL needs groups with right and wrong samples, and room to gain by calling more
TOOL_CALL_RATE = (0.15, 0.40)
ACCURACY_WITH_TOOLS = (0.15, 0.35)
MAX_ACCURACY_WITHOUT_TOOLS = 0.08
MIN_TOOL_CALL_ACCURACY = 0.80  # a call is nearly always right: +10 points are there to take

SHORT = dataclasses.replace(tiny_agent.RECIPE, steps=6, batch_size=8, eval_prompts=4, eval_samples_per_prompt=2)
PROBLEM = Problem(prompt="12*34=", answer="408", index=0)


@pytest.fixture(scope="module")
def tok():
    return tiny_agent.build_tokenizer()


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# --- the tokenizer and the demonstrations (fast) ---------------------------------------------


def test_vocabulary_extends_tiny_adders(tok):
    from dapo_flow.models.tokenizer import ARITHMETIC_CHARS, build_char_tokenizer

    assert tiny_agent.CHARS.startswith(ARITHMETIC_CHARS)  # the same ids for tiny-adder's characters
    adder = build_char_tokenizer()
    assert enc(tok, "0123456789+= -") == enc(adder, "0123456789+= -")
    assert len(tok) == tiny_agent.VOCAB_SIZE == tiny_agent.shape_config()["vocab_size"]


@pytest.mark.parametrize("text", ["12*34=", "<call>calculator: 12*34</call>", "<result>408</result>", "408",
                                  "error: 1/0"])
def test_tokenizer_round_trips_the_format_one_token_a_character(tok, text):
    ids = enc(tok, text)
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode(text) == [tok.bos_token_id] + ids  # prompts get BOS


def test_tool_demonstration_is_the_agent_loops_layout(tok):
    """response = enc(call) + [eos] + enc(observation) + enc(answer) + [eos]; mask 0 on the observation."""
    demo = tiny_agent.demonstration(tok, PROBLEM, use_tool=True)
    eos = tok.eos_token_id
    call, obs = enc(tok, "<call>calculator: 12*34</call>"), enc(tok, "<result>408</result>")
    assert demo.prompt_ids == [tok.bos_token_id] + enc(tok, "12*34=")
    assert demo.response_ids == call + [eos] + obs + enc(tok, "408") + [eos]
    assert demo.loss_mask == [1] * (len(call) + 1) + [0] * len(obs) + [1] * 4
    assert demo.uses_tool
    assert tok.decode(demo.response_ids, skip_special_tokens=True) == \
        "<call>calculator: 12*34</call><result>408</result>408"
    assert verify_tool_arith(tok.decode(demo.response_ids, skip_special_tokens=True), PROBLEM.answer) == 1.0
    length = len(demo.prompt_ids) + len(demo.response_ids)
    assert length == 62 and 2 * (length + 2) <= tiny_agent.RECIPE.max_position_embeddings  # 4-digit products: 64; room for a third turn


def test_direct_demonstration(tok):
    demo = tiny_agent.demonstration(tok, PROBLEM, use_tool=False)
    assert demo.response_ids == enc(tok, "408") + [tok.eos_token_id] and demo.loss_mask == [1] * 4
    assert not demo.uses_tool


def test_demonstrations_mix_is_seeded_and_near_the_fraction(tok):
    problems = ToolArithTask().problems("train")[:2000]
    demos = tiny_agent.demonstrations(tok, problems, 0.2, seed=0)
    share = sum(d.uses_tool for d in demos) / len(demos)
    assert 0.17 <= share <= 0.23
    again = tiny_agent.demonstrations(tok, problems, 0.2, seed=0)
    assert [d.uses_tool for d in again] == [d.uses_tool for d in demos]
    assert [d.uses_tool for d in tiny_agent.demonstrations(tok, problems, 0.2, seed=1)] != [d.uses_tool for d in demos]


def test_loss_mask_zeroes_exactly_the_observation_tokens(tok):
    tool = tiny_agent.demonstration(tok, PROBLEM, use_tool=True)
    direct = tiny_agent.demonstration(tok, PROBLEM, use_tool=False)
    demos = [tool, direct]
    ids, mask, labels = supervised_labels([d.prompt_ids for d in demos], [d.response_ids for d in demos],
                                          pad_id=tok.pad_token_id, loss_masks=[d.loss_mask for d in demos])
    for row, d in enumerate(demos):
        p, r = len(d.prompt_ids), len(d.response_ids)
        expected = [-100] * p + [t if m else -100 for t, m in zip(d.response_ids, d.loss_mask)]
        expected += [-100] * (ids.shape[1] - p - r)  # padding
        assert labels[row].tolist() == expected
        assert mask[row].tolist() == [1] * (p + r) + [0] * (ids.shape[1] - p - r)
    trained = tok.decode([t for t in labels[0].tolist() if t != -100])
    assert trained == "<call>calculator: 12*34</call></s>408</s>"  # both turns and EOSes; no observation


def test_labels_without_masks_are_the_plain_fit(tok):
    ids, _, labels = supervised_labels([[1, 5], [1]], [[6, 2], [7, 8, 2]], pad_id=0)
    assert labels.tolist() == [[-100, -100, 6, 2], [-100, 7, 8, 2]]
    with pytest.raises(ValueError, match="a loss mask of 1 tokens for a response of 2"):
        supervised_labels([[1]], [[6, 2]], pad_id=0, loss_masks=[[1]])
    with pytest.raises(ValueError, match="1 loss masks for 2 responses"):
        supervised_labels([[1], [1]], [[6, 2], [6]], pad_id=0, loss_masks=[[1, 1]])


def test_group_weights_give_the_mixed_batch_token_mean():
    """Groups of 3 rows x 2 tokens and 1 row x 6: a mixed batch of 2 rows scores 6 tokens on
    average; each group is drawn half the time; the expected weighted token count is 1 per step."""
    sizes, tokens_per_row = [3, 1], [2, 6]
    weights = group_weights(sizes, scored_tokens=3 * 2 + 6, batch_size=2)
    assert weights == pytest.approx([3 / 4 * 2 / 6, 1 / 4 * 2 / 6])
    expected = sum(0.5 * w * 2 * n for w, n in zip(weights, tokens_per_row))
    assert expected == pytest.approx(1.0)
    # a token weighs the same in either group: weight / P(draw) * P(row) is constant per token
    assert weights[0] * 0.5 / (3 / 4) == pytest.approx(weights[1] * 0.5 / (1 / 4))


@pytest.mark.parametrize("text, call", [
    ("<call>calculator: 12*34</call>", (12, 34)),
    (" <call>calculator: 12*34</call>\n", (12, 34)),
    ("<call>calculator: 12*3</call>", (12, 3)),
    ("<call>calculator: 12*34</call>408", None),
    ("<call>calculator: 12+34</call>", None),
    ("<call>calculator: 12*34</cal>", None),
    ("<call>calculater: 12*34</call>", None),
    ("408", None),
])
def test_calculator_call(text, call):
    assert tiny_agent.calculator_call(text) == call


# --- a short-recipe build: files, shape, determinism -----------------------------------------


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory) -> Path:
    return tiny_agent.build_tiny_agent(tmp_path_factory.mktemp("tiny-agent"), progress=False, recipe=SHORT)


def test_short_build_is_a_llama_directory_with_the_declared_shape(short_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((short_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 32  # a vLLM CPU head size
    assert {k: config[k] for k in tiny_agent.shape_config(SHORT)} == tiny_agent.shape_config(SHORT)
    assert model_config("builtin:tiny-agent") == tiny_agent.shape_config()
    model, tok = AutoModelForCausalLM.from_pretrained(short_dir), AutoTokenizer.from_pretrained(short_dir)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    text = "<call>calculator: 12*34</call>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_short_build_info_and_determinism(short_dir, tmp_path):
    """A few-step build records its figures as the build measures them and rebuilds byte for byte.
    The shipped recipe runs the same code for more steps; that its build on this machine is the
    one the documented figures came from, the agent graph's figure test shows (test_learning)."""
    info = json.loads((short_dir / tiny_agent.BUILD_INFO).read_text())
    assert info["name"] == "tiny-agent" and info["recipe_version"] == tiny_agent.RECIPE_VERSION
    # the recorded figures are the sampler's on the build's protocol (as the build runs it: one
    # thread, deterministic kernels), each under its own name
    with deterministic_torch(0):
        figures = tiny_agent.sampled_tool_accuracy(
            short_dir, ToolArithTask().problems("val")[:SHORT.eval_prompts], samples=SHORT.eval_samples_per_prompt,
            seed=SHORT.eval_seed, max_tokens=SHORT.eval_max_tokens)
    assert {k: info[k] for k in ("val_sampled_accuracy", "val_tool_call_rate", "val_accuracy_without_tools",
                                 "val_tool_call_accuracy")} == {
        "val_sampled_accuracy": figures.accuracy_with_tools, "val_tool_call_rate": figures.tool_call_rate,
        "val_accuracy_without_tools": figures.accuracy_without_tools,
        "val_tool_call_accuracy": figures.tool_call_accuracy}
    assert info["val_accuracy_protocol"].startswith(
        f"first {SHORT.eval_prompts} val prompts x {SHORT.eval_samples_per_prompt} samples, temperature 1.0")
    again = tiny_agent.build_tiny_agent(tmp_path / "again", progress=False, recipe=SHORT)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json", tiny_agent.BUILD_INFO):
        if name != tiny_agent.BUILD_INFO:
            assert (again / name).read_bytes() == (short_dir / name).read_bytes(), name
    assert {k: v for k, v in json.loads((again / tiny_agent.BUILD_INFO).read_text()).items() if k != "train_seconds"} \
        == {k: v for k, v in info.items() if k != "train_seconds"}


class FakeAlwaysCallingPolicy:
    """Stands in for HFPolicy in the sampler's unit test: turn 1 is always the well-formed call
    for the prompt; turn 2 copies the observation's number into the answer on even samples and
    answers 0 on odd ones. Records the prompts of each generate call."""

    def __init__(self, model_dir):
        self.tokenizer = tiny_agent.build_tokenizer()
        FakeAlwaysCallingPolicy.turns = []

    def generate(self, prompts, cfg):
        from dapo_flow.data.tool_arith import call_text
        from dapo_flow.models.sampling import Rollouts

        tok = self.tokenizer
        FakeAlwaysCallingPolicy.turns.append([list(p) for p in prompts])
        replies = []
        for p in prompts:
            text = tok.decode(p, skip_special_tokens=True)
            for _ in range(cfg.n):
                if "<result>" not in text:
                    reply = call_text(text)
                else:
                    reply = text.rsplit("<result>", 1)[1].split("</result>")[0] if len(replies) % 2 == 0 else "0"
                replies.append(tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
        return Rollouts(prompt_index=np.repeat(np.arange(len(prompts)), cfg.n).astype(np.int32),
                        sample_idx=np.tile(np.arange(cfg.n), len(prompts)).astype(np.int32), response_ids=replies,
                        logprobs=[[0.0] * len(r) for r in replies], truncated=np.zeros(len(replies), dtype=bool))


def test_sampler_runs_the_calculator_and_verifies(tok, monkeypatch):
    """A model that always calls: the sampler appends Python's product and samples turn 2."""
    from dapo_flow.data.tool_arith import call_text, observation_text
    from dapo_flow.models import hf

    monkeypatch.setattr(hf, "HFPolicy", FakeAlwaysCallingPolicy)
    problems = ToolArithTask().problems("val")[:3]
    figures = tiny_agent.sampled_tool_accuracy(Path("unused"), problems, samples=2, seed=0)
    first, second = FakeAlwaysCallingPolicy.turns
    expected = []
    for p in problems:  # each sample's turn 2 starts from its call and the observation of the product
        turn2 = tok.encode(p.prompt) + enc(tok, call_text(p.prompt)) + [tok.eos_token_id] + \
            enc(tok, observation_text(p.answer))
        expected += [turn2, turn2]
    assert first == [tok.encode(p.prompt) for p in problems] and second == expected
    # every sample called (so none is right without the calculator); the even ones copied the
    # product and are right, the odd ones answered 0
    assert figures == tiny_agent.ToolFigures(tool_call_rate=1.0, accuracy_with_tools=0.5,
                                             accuracy_without_tools=0.0, tool_call_accuracy=0.5)


# --- the cached, tuned build -----------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_path() -> Path:
    """The builtin tiny-agent model dir, built once into the persistent cache (~2 min)."""
    return resolve_model("builtin:tiny-agent", progress=False)


@pytest.mark.slow  # reads the shipped build: on a fresh machine the suite builds it (~1.6 min of one core)
@pytest.mark.models("tiny-agent")
def test_cached_build_name_and_recorded_figures_in_band(agent_path):
    info = json.loads((agent_path / tiny_agent.BUILD_INFO).read_text())
    assert agent_path.name == f"tiny-agent-v{tiny_agent.RECIPE_VERSION}"
    assert info["recipe"] == dataclasses.asdict(tiny_agent.RECIPE)
    assert TOOL_CALL_RATE[0] <= info["val_tool_call_rate"] <= TOOL_CALL_RATE[1]
    assert ACCURACY_WITH_TOOLS[0] <= info["val_sampled_accuracy"] <= ACCURACY_WITH_TOOLS[1]
    assert info["val_accuracy_without_tools"] <= MAX_ACCURACY_WITHOUT_TOOLS
    assert info["val_tool_call_accuracy"] >= MIN_TOOL_CALL_ACCURACY


@pytest.mark.slow  # reads the shipped build: on a fresh machine the suite builds it (~1.6 min of one core)
@pytest.mark.models("tiny-agent")
def test_remeasured_figures_in_band(agent_path):
    """Other prompts (val 200..399) and another sampling seed than the build's."""
    val = ToolArithTask().problems("val")[200:400]
    figures = tiny_agent.sampled_tool_accuracy(agent_path, val, samples=4, seed=99)
    assert TOOL_CALL_RATE[0] <= figures.tool_call_rate <= TOOL_CALL_RATE[1]
    assert ACCURACY_WITH_TOOLS[0] <= figures.accuracy_with_tools <= ACCURACY_WITH_TOOLS[1]
    assert figures.accuracy_without_tools <= MAX_ACCURACY_WITHOUT_TOOLS
    assert figures.tool_call_accuracy >= MIN_TOOL_CALL_ACCURACY


@pytest.mark.slow  # reads the shipped build: on a fresh machine the suite builds it (~1.6 min of one core)
@pytest.mark.models("tiny-agent")
def test_cached_tokenizer_round_trips_a_whole_conversation(agent_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(agent_path)
    demo = tiny_agent.demonstration(tok, PROBLEM, use_tool=True)
    assert demo.response_ids == tiny_agent.demonstration(tiny_agent.build_tokenizer(), PROBLEM,
                                                         use_tool=True).response_ids
    assert tok.decode(demo.prompt_ids + demo.response_ids) == \
        "<s>12*34=<call>calculator: 12*34</call></s><result>408</result>408</s>"
