"""reasoning_gym sources: items fixed by seed, train / val kept apart, the library's own score
as the reward, and every bad setting a validation error at its line."""

from __future__ import annotations

import sys

import pytest
import reasoning_gym as rg
from reasoning_gym.utils import extract_answer

from dapo_flow.data import reasoning_gym as gym
from dapo_flow.data.reward_pool import RewardSpec, evaluate, resolve_reward
from dapo_flow.errors import GraphError
from dapo_flow.graph.checks import validate
from dapo_flow.graph.loader import load

SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 200 distinct items


def test_items_are_fixed_by_seed_and_carry_the_prompt_convention():
    a, _ = gym.records("chain_sum", SUM, seed=5, size=20, options={})
    b, _ = gym.records("chain_sum", SUM, seed=5, size=20, options={})
    c, _ = gym.records("chain_sum", SUM, seed=6, size=20, options={})
    assert a == b and a != c
    assert [i for i, _ in a] == list(range(20))
    system, user = a[0][1]["prompt"]
    assert system == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]} and "<answer>" in system["content"]
    assert user["content"] == rg.create_dataset("chain_sum", **SUM, seed=5, size=20)[0]["question"]
    assert a[0][1]["data_source"] == "chain_sum"
    direct, _ = gym.records("chain_sum", SUM, seed=5, size=1, options={"system_prompt": "direct"})
    assert direct[0][1]["prompt"][0]["content"] == rg.utils.SYSTEM_PROMPTS["direct"]


def test_validation_items_never_repeat_train_items():
    # default seeds: [0, 300) for train, [1e8, 1e8 + 100) for val: no seed shared, yet on a
    # 200-item task some questions recur, and those are dropped and counted
    train = gym.questions("chain_sum", SUM, seed=0, size=300)
    val, dropped = gym.records("chain_sum", SUM, seed=gym.default_seed("val", 0), size=100, options={}, avoid=train)
    questions = {fields["prompt"][-1]["content"] for _, fields in val}
    assert dropped > 0 and len(val) + dropped == 100 and not questions & train
    assert gym.overlap_problem("chain_sum", (0, 300), (299, 10))
    assert not gym.overlap_problem("chain_sum", (0, 300), (300, 10))


@pytest.mark.parametrize("name,config", [("chain_sum", SUM), ("leg_counting", {}), ("number_sorting", {}),
                                         ("letter_counting", {}), ("spell_backward", {"min_word_len": 3}),
                                         ("caesar_cipher", {"delimiter": " ", "min_words": 1, "max_words": 1,
                                                            "min_rotation": 3, "max_rotation": 3})])
def test_the_reward_is_the_librarys_score_answer(name, config):
    dataset = rg.create_dataset(name, **config, seed=3, size=4)
    verify = resolve_reward(RewardSpec(gym.REWARD, correct=1.0, wrong=0.0))
    for i, (_, fields) in enumerate(gym.records(name, config, seed=3, size=4, options={})[0]):
        entry = dataset[i]
        responses = {"right": f"think...\n<answer>{entry['answer']}</answer>", "wrong": "<answer>no 12345</answer>",
                     "malformed": f"the answer is {entry['answer']}", "partial": f"<answer>7{entry['answer']}</answer>"}
        for kind, text in responses.items():
            want = dataset.score_answer(extract_answer(text), entry)
            score, acc, _ = evaluate(verify, RewardSpec(gym.REWARD, correct=1.0, wrong=0.0), text, fields["ground_truth"])
            assert score == pytest.approx(want, abs=1e-12), (name, kind)
            assert acc == float(want == 1.0)
        assert gym.verify_gym(responses["right"], fields["ground_truth"], correct=1.0, wrong=-1.0) == 1.0
        assert gym.verify_gym(responses["malformed"], fields["ground_truth"], correct=1.0, wrong=-1.0) == -1.0


GRAPH = """\
name: gym
models:
  policy: {{path: "builtin:tiny-adder"}}
data:
{data}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts], params: {{n: 2, max_tokens: 4}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{reward: "builtin:reasoning-gym"}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [verify]}}
  - {{id: adv, op: advantage, inputs: [old_logp]}}
  - {{id: train, op: update, model: policy, inputs: [adv]}}
"""


def _problems(tmp_path, data: str) -> list[str]:
    path = tmp_path / "g.yaml"
    path.write_text(GRAPH.format(data=data))
    with pytest.raises(GraphError) as err:
        validate(load(path))
    return [p.render() for p in err.value.problems]


@pytest.mark.parametrize("data,line,says", [
    ('  train: {source: "reasoning_gym:chain_sum", sources: [{source: "reasoning_gym:gcd"}]}', 5, "not both"),
    ("  train: {split: train}", 5, "one of the two"),
    ("  train: {sources: []}", 5, "is empty"),
    ('  train:\n    sources:\n      - {source: "reasoning_gym:gcd", weight: 1}\n      - {source: "reasoning_gym:lcm", weight: 0}',
     8, "sources[1].weight: Input should be greater than 0"),
    ('  train: {source: "reasoning_gym:gcd", weight: 2}', 4, "a single source takes none"),
    ('  train: {source: "reasoning_gym:chain_sun"}', 5, "did you mean 'chain_sum'"),
    ('  train: {source: "reasoning_gym:gcd", config: {max_valu: 9}}', 5, "did you mean 'max_value'"),
    ('  train: {source: "reasoning_gym:gcd", config: {min_value: 9, max_value: 2}}', 5, "rejects"),
    ('  train: {source: "reasoning_gym:gcd", stream: true}', 5, "stream: true reads a .parquet"),
    ('  train: {source: "reasoning_gym:gcd", size: 100}\n  val: {source: "reasoning_gym:gcd", seed: 50, size: 10}',
     6, "data.val.seed: reasoning_gym:gcd: the val items' seeds 50..59 overlap"),
])
def test_bad_settings_are_errors_at_their_line(tmp_path, data, line, says):
    problems = _problems(tmp_path, data)
    assert any(f"g.yaml:{line}:" in p and says in p for p in problems), problems


def test_a_missing_extra_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now fails
    problems = _problems(tmp_path, '  train: {source: "reasoning_gym:gcd"}')
    assert any("g.yaml:5:" in p and "pip install 'dapo-flow[gym]'" in p for p in problems), problems


def test_a_cli_validate_of_a_bad_gym_graph_exits_2(tmp_path, capsys):
    from dapo_flow.cli import main

    path = tmp_path / "g.yaml"
    path.write_text(GRAPH.format(data='  train: {source: "reasoning_gym:chain_sun"}'))
    assert main(["validate", str(path)]) == 2
    assert "did you mean 'chain_sum'" in capsys.readouterr().err


def test_a_validation_split_left_empty_by_train_repeats_says_so():
    from dapo_flow.data.prompts import load_prompts
    from dapo_flow.errors import DataError

    avoid = gym.questions("chain_sum", SUM, seed=0, size=2000)  # all 200 distinct items
    with pytest.raises(DataError, match="every one of its 20 items repeats a train item"):
        load_prompts("reasoning_gym:chain_sum", tokenizer=None, seed=gym.default_seed("val", 0), size=20,
                     config=SUM, avoid=avoid)
