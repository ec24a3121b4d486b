"""`train.pack`: a pass's rows concatenated into one sequence (no padding, attention kept inside
each row by restarting positions) gives the padded path's logprobs, entropy, values, losses and
gradients, on Qwen2- and Llama-style models, chunked or not; an update trains the same weights."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
import torch

from dapo_flow.core import columns as C
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.packing import first_fit_bins, pack_rows

from test_mixed_precision import _batch, _problems, _update, _with_old_logp


def _save(model, out, tokenizer) -> str:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory) -> str:
    """A random model of the architecture with tiny-adder's char tokenizer (GQA: 4 / 2 heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from dapo_flow.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    shape = dict(vocab_size=max(64, len(tok)), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM(Qwen2Config(**shape)) if request.param == "qwen2"
             else LlamaForCausalLM(LlamaConfig(**shape)))
    return _save(model, tmp_path_factory.mktemp(request.param), tok)


def _rows(count: int = 7, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 1-9 tokens and responses of 0-12 (an empty one included): ragged both ways.
    Every third row is long (8 + 12 tokens) and the others short (at most 3 + 5), so the rows of
    any pass of 3 or more share bins (a long row's length is a bin's capacity)."""
    rng = random.Random(seed)
    long = [i % 3 == 0 for i in range(count)]
    prompts = [[rng.randrange(3, 30) for _ in range(8 if big else rng.randint(1, 3))] for big in long]
    responses = [[rng.randrange(3, 30) for _ in range(12 if big else rng.randint(1, 5))] for big in long]
    responses[2] = []
    return prompts, responses


@pytest.fixture()
def bins_made(monkeypatch) -> list[list[int]]:
    """Every bin the packed passes make (the rows in it), so a test can assert that rows share
    bins: with one row a bin, packing is the padded path and nothing that tells rows apart inside
    a sequence (restarting positions, attention kept in each row) is checked."""
    from dapo_flow.models import packing

    made: list[list[int]] = []

    def recording(lengths, capacity):
        bins = first_fit_bins(lengths, capacity)
        made.extend(bins)
        return bins

    monkeypatch.setattr(packing, "first_fit_bins", recording)
    return made


def _shared(bins: list[list[int]]) -> int:
    """Bins holding several rows."""
    return sum(len(b) > 1 for b in bins)


def test_pack_rows_layout():
    # rows of 5, 2 and 3 tokens: bins of 5, the longest alone, the other two together
    packed = pack_rows([[5, 6], [7], [12]], [[8, 9, 10], [11], [13, 14]])
    assert packed.input_ids.tolist() == [[5, 6, 8, 9, 10], [12, 13, 14, 7, 11]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed.predict.tolist() == [1, 2, 3, 8, 5, 6] and packed.targets.tolist() == [8, 9, 10, 11, 13, 14]
    assert packed.response_mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert packed.unpack(torch.arange(1.0, 7.0)).tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    # a bin's unfilled tail is a segment of its own (positions restart)
    tail = pack_rows([[1, 2, 3], [4]], [[5, 6], [7]])
    assert tail.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]


def test_first_fit_bins_never_exceed_the_capacity():
    rng = random.Random(7)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    bins = first_fit_bins(lengths, 50)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 50 for b in bins)
    assert len(bins) < 40  # rows share bins


@pytest.mark.parametrize("chunk", [None, 5])
def test_packed_logprobs_and_entropy_are_the_padded_ones(model_dir, chunk, bins_made):
    prompts, responses = _rows()
    padded = HFPolicy(model_dir, logprob_chunk_tokens=chunk)
    packed = HFPolicy(model_dir, logprob_chunk_tokens=chunk, pack=True)
    for micro in (3, 64):  # several passes, and one
        a = padded.response_logprobs(prompts, responses, micro_batch_size=micro, with_entropy=True, temperature=0.7)
        bins_made.clear()
        b = packed.response_logprobs(prompts, responses, micro_batch_size=micro, with_entropy=True, temperature=0.7)
        assert _shared(bins_made) >= (2 if micro == 3 else 1), bins_made
        assert torch.equal(a[2], b[2])
        torch.testing.assert_close(b[0], a[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b[1], a[1], rtol=0, atol=1e-5)


def test_packed_losses_and_gradients_are_the_padded_ones(model_dir, bins_made):
    prompts, responses = _rows(seed=1)
    grads = []
    for pack in (False, True):
        policy = HFPolicy(model_dir, trainable=True, pack=pack)
        logp, ent, mask = policy.response_logprobs(prompts, responses, with_entropy=True, grad=True)
        loss = -(logp * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters()}))
    assert _shared(bins_made) >= 1, bins_made  # one pass: its short rows share bins
    (loss_a, grad_a), (loss_b, grad_b) = grads
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-5)
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], rtol=0, atol=1e-5, msg=name)


def test_packed_values_are_the_padded_ones(model_dir, bins_made):
    prompts, responses = _rows(seed=2)
    padded = HFPolicy(model_dir, head="value")
    packed = HFPolicy(model_dir, head="value", pack=True)
    with torch.no_grad():  # a value head starts at zero: give it a function
        for policy in (padded, packed):
            torch.manual_seed(3)
            for p in policy.model.score.parameters():
                p.copy_(torch.randn_like(p))
    a, mask_a = padded.response_values(prompts, responses, micro_batch_size=3)
    b, mask_b = packed.response_values(prompts, responses, micro_batch_size=3)
    assert _shared(bins_made) >= 2, bins_made  # passes of 3 rows: a long one and two short sharing a bin
    assert torch.equal(mask_a, mask_b)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def _ragged(batch: pa.Table) -> pa.Table:
    """tiny-adder's rows are all about one length (one row a bin): every third response made long
    (its answer 10 times over), so the short rows of a pass share a long row's bin."""
    responses = batch.column(C.RESPONSE_IDS).to_pylist()
    longer = [r[:-1] * 10 + r[-1:] if i % 3 == 0 else r for i, r in enumerate(responses)]
    return batch.set_column(batch.schema.get_field_index(C.RESPONSE_IDS), C.RESPONSE_IDS, pa.array(longer, C.TOKENS))


def test_an_update_trains_the_same_weights_packed(tiny_adder_path, bins_made):
    weights = []
    for pack in (False, True):
        spec = ModelSpec(path="builtin:tiny-adder", train={"pack": pack})
        policy = HFPolicy(tiny_adder_path, trainable=True, pack=pack)
        batch = _with_old_logp(policy, _ragged(_batch(policy, _problems(12))))
        bins_made.clear()  # the update's passes only
        row = _update(policy, spec, micro_batch_size=5)(batch).to_pylist()[0]
        weights.append((row, {n: p.detach().clone() for n, p in policy.model.named_parameters()}))
    assert _shared(bins_made) >= 4, bins_made  # the packed update's passes put rows together
    (row_a, a), (row_b, b) = weights
    assert row_b["actor/pg_loss"] == pytest.approx(row_a["actor/pg_loss"], abs=1e-6)
    # an AdamW step moves a weight by about lr (1e-3) whatever its gradient's size, so a near-zero
    # gradient's float rounding (packed, its sums run in another order) moves it by up to a few %
    # of that (measured 1.8e-5); the gradients themselves agree to 1e-5 (the test above)
    worst = {name: float((b[name] - a[name]).abs().max()) for name in a}
    assert max(worst.values()) <= 3e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert sum(worst.values()) / len(worst) <= 1e-5


def test_explain_says_packed_and_prices_the_one_mask():
    from pathlib import Path

    from dapo_flow.graph.explain import explain
    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.plan import Cluster

    graph = Path(__file__).resolve().parents[2] / "graphs" / "dapo.yaml"
    text = explain(edit_file(graph, parse_cli_edits([("set", "models.policy.train.pack=true")])).compile(Cluster(cpus=2)))
    assert "packed micro-batches" in text and "attention masks (packed rows)" in text
