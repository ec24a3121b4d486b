"""Device placement without a GPU: the training operators' losses are checked with the model's
outputs on the `meta` device, which (like CUDA) refuses to be combined with host tensors. An
operator that built a mask or an advantage with ``torch.from_numpy`` and combined it with the
model's output itself would raise here as it raises on CUDA ("Expected all tensors to be on the
same device"); the policy's ``to_device`` (dapo_flow.models.devices) is the one way across.
Host reads of device values (``float()``, ``.tolist()``) are allowed on CUDA; on `meta` there is
no value, so the fake below returns zeros for them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models.devices import host_floats, to_device, to_host
from dapo_flow.operators.critic_update import CriticUpdate, ValueLoss
from dapo_flow.operators.critic_update import Params as CriticParams
from dapo_flow.operators.update import Params, PolicyLoss, Update

META = torch.device("meta")


class FakeAcceleratorPolicy:
    """A test double of HFPolicy whose gradient passes answer on `meta`, shaped as the real one's
    (rows, longest response), and whose ``to_device`` is the real placement function."""

    sharded = False
    eos_id = 0
    device = META

    def __init__(self):
        self.model = torch.nn.Linear(2, 2)  # what the operator's AdamW optimizes

    def to_device(self, value):
        return to_device(value, self.device)

    def set_weights_version(self, version):
        self.weights_version = version

    def _shape(self, responses):
        return len(responses), max(map(len, responses))

    def response_logprobs(self, prompts, responses, *, temperature=1.0, with_entropy=False, grad=False,
                          micro_batch_size=64, at_ids=None):
        assert grad, "the training operators' passes are gradient passes"
        shape = self._shape(responses)
        logp = torch.zeros(shape, device=META, requires_grad=True)
        entropy = torch.zeros(shape, device=META, requires_grad=True)
        if at_ids is None:
            return logp, entropy, torch.ones(shape, dtype=torch.bool, device=META)
        assert at_ids.device == META and tuple(at_ids.shape[:2]) == shape  # the teacher's ids, moved by to_device
        at = torch.zeros(at_ids.shape, device=META, requires_grad=True)
        return logp, entropy, torch.ones(shape, dtype=torch.bool, device=META), (at_ids, at)

    def response_values(self, prompts, responses, *, grad=False, micro_batch_size=64):
        assert grad
        shape = self._shape(responses)
        return torch.zeros(shape, device=META, requires_grad=True), torch.ones(shape, dtype=torch.bool, device=META)


@pytest.fixture
def host_reads_of_meta_read_zeros(monkeypatch):
    """CUDA lets the host read a value back (a synchronising copy); `meta` has none to read."""
    def fake(original, zero):
        def read(self, *args, **kwargs):
            return zero(self) if self.is_meta else original(self, *args, **kwargs)
        return read

    monkeypatch.setattr(torch.Tensor, "tolist", fake(torch.Tensor.tolist, lambda t: np.zeros(t.shape).tolist()))
    monkeypatch.setattr(torch.Tensor, "item", fake(torch.Tensor.item, lambda t: 0.0))
    monkeypatch.setattr(torch.Tensor, "__float__", fake(torch.Tensor.__float__, lambda t: 0.0))
    monkeypatch.setattr(torch.Tensor, "__bool__", fake(torch.Tensor.__bool__, lambda t: True))


def _batch(rows: int = 4) -> pa.Table:
    responses = [[5, 6, 0][: 1 + i % 3] for i in range(rows)]
    lengths = [len(r) for r in responses]
    return pa.table({
        C.PROMPT_IDS: pa.array([[1, 2, 3]] * rows, C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.OLD_LOGP: pa.array([[-1.0] * n for n in lengths], C.TOKEN_FLOATS),
        C.REF_LOGP: pa.array([[-1.1] * n for n in lengths], C.TOKEN_FLOATS),
        C.ADVANTAGE: pa.array(np.linspace(-1, 1, rows, dtype=np.float32)),
        C.TOKEN_ADVANTAGE: pa.array([[0.5] * n for n in lengths], C.TOKEN_FLOATS),
        C.TRUNCATED: pa.array([False, True] * (rows // 2)),
        C.VALUES: pa.array([[0.1] * n for n in lengths], C.TOKEN_FLOATS),
        C.RETURNS: pa.array([[0.3] * n for n in lengths], C.TOKEN_FLOATS),
        C.TEACHER_TOPK_IDS: pa.array([[[5, 6]] * n for n in lengths], C.TOKEN_TOPK_IDS),
        C.TEACHER_TOPK_LOGP: pa.array([[[-0.2, -1.8]] * n for n in lengths], C.TOKEN_TOPK_FLOATS),
    })


def _op(cls, params):
    ctx = OpContext("train", model=SimpleNamespace(policy=FakeAcceleratorPolicy(), spec=ModelSpec(path="x")))
    return cls(params, ctx)


def test_meta_outputs_refuse_host_tensors_as_cuda_outputs_do():
    """The check's premise: combining a host tensor with a `meta` one raises."""
    host = torch.from_numpy(np.ones((2, 3), dtype=bool))
    with pytest.raises((RuntimeError, NotImplementedError)):
        host & torch.ones((2, 3), dtype=torch.bool, device=META)


@pytest.mark.parametrize("params", [
    dict(),
    dict(kl_coef=0.1, entropy_coef=0.01, mask_truncated=True),
    dict(advantage_column="token_advantage", policy_loss="gspo", clip_low=3e-4, clip_high=4e-4),
    dict(policy_loss="cispo", loss_agg_mode="seq-mean-token-mean"),
    dict(distill_topk_coef=0.5),
], ids=["dapo", "kl-entropy-masked", "token-adv-gspo", "cispo-seq-mean", "distill-topk"])
def test_update_loss_stays_on_the_models_device(host_reads_of_meta_read_zeros, params):
    advantage = params.pop("advantage_column", "advantage")
    op = _op(Update, Update.resolve(Params(advantage_column=advantage, loss_mask="ignore", **params), {}))
    batch = _batch()
    data = op._arrays(batch)
    rows = np.arange(batch.num_rows)
    loss, stats = PolicyLoss(op.policy, op.params, data)(rows, n_tokens=int(data["mask"].sum()), n_seqs=batch.num_rows)
    assert loss.device == META and loss.requires_grad
    assert all(isinstance(v, float) for v in stats.values()) and "actor/pg_loss" in stats


def test_critic_loss_stays_on_the_models_device(host_reads_of_meta_read_zeros):
    op = _op(CriticUpdate, CriticParams())
    batch = _batch()
    data = op._arrays(batch)
    loss, stats = ValueLoss(op.policy, op.params, data)(np.arange(batch.num_rows), n_tokens=int(data["mask"].sum()),
                                                        n_seqs=4)
    assert loss.device == META and loss.requires_grad
    assert set(stats) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"}


def test_optimizer_state_reaches_the_driver_on_the_host():
    op = _op(Update, Params(advantage_column="advantage", loss_mask="ignore"))
    op.policy.model(torch.ones(1, 2)).sum().backward()
    op.trainer.optimizer.step()  # Adam's moments exist now
    state = op.state_dict()["optimizer"]["state"]
    assert state and all(t.device.type == "cpu" for s in state.values() for t in s.values()
                         if isinstance(t, torch.Tensor))


def test_to_device_and_to_host_walk_nested_values():
    value = {"a": np.arange(3), "b": [torch.ones(2, requires_grad=True), None], "c": (np.zeros(1), "x")}
    moved = to_device(value, META)
    assert moved["a"].device == META and moved["b"][0].device == META and moved["c"][0].device == META
    assert moved["b"][1] is None and moved["c"][1] == "x" and isinstance(moved["c"], tuple)
    back = to_host({"t": torch.ones(2, requires_grad=True) * 2, "n": 3})
    assert back["t"].device.type == "cpu" and not back["t"].requires_grad and back["n"] == 3
    assert torch.from_numpy(value["a"]).data_ptr() == to_device(value, "cpu")["a"].data_ptr()  # no copy on the host


def test_host_floats_keeps_order_and_values():
    out = host_floats({"x": torch.tensor(1.5), "y": 2, "z": torch.tensor([[3.25]])})
    assert list(out) == ["x", "y", "z"] and out == {"x": 1.5, "y": 2.0, "z": 3.25}
