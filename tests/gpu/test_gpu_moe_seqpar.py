"""Routing replay and Ulysses sequence parallelism on CUDA: the claims of the CPU tests
(tests/models/test_routing_replay_hf.py, tests/test_sequence_parallel.py) with the models and
their inputs on the GPU.

Routing replay: builtin:tiny-moe's rollout records every prompt and fed response token's experts
(the record kept on the device, the rows back on the host), replaying them on the rollout's own
weights changes nothing, on a perturbed router brings the logprobs closer to the rollout's, and
a gradient pass replays them too (the update's), with the router's gradient there.

Sequence parallelism: one GPU holds one rank, so the split forward runs over an NCCL group of
one (every all-to-all and gather runs, over one rank; two ranks: the CPU test over gloo): its
logprobs, entropy and gradients equal the unsplit forward's, packed and padded, the head at once
and in chunks. ``DAPO_FLOW_TEST_DEVICE=cpu`` rehearses both on the CPU (gloo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

PROMPTS = ["12+34=", "7+5=", "40+41=", "3+99="]


def _mean_mismatch(logp: torch.Tensor, rollout_lp: list[list[float]]) -> float:
    logp = logp.detach().cpu()
    total = sum(float(np.abs(logp[i, :len(r)].numpy() - np.array(r)).sum()) for i, r in enumerate(rollout_lp))
    return total / sum(map(len, rollout_lp))


def _perturb_routers(policy) -> None:
    """10% relative noise on the routers' weights (seeded on the host, then moved): a router a
    step ahead of the rollout's, as in the CPU test."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".mlp.gate." in name:
                param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen).to(param.device))


def test_routing_replay_records_and_replays_on_the_device(builtin, device):
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.moe import ReplayTally
    from dapo_flow.models.sampling import SamplingConfig

    moe = builtin("tiny-moe")
    policy = HFPolicy(moe, device=str(device))
    prompts = policy.tokenizer(PROMPTS)["input_ids"]
    out = policy.generate(prompts, SamplingConfig(n=4, max_tokens=8, seed=3, record_routes=True))
    assert out.routes is not None and len(out.routes) == len(out.response_ids)
    for s, (route, response) in enumerate(zip(out.routes, out.response_ids)):
        assert isinstance(route, np.ndarray) and route.dtype == np.int16  # back on the host
        assert route.shape == (len(prompts[s // 4]) + len(response), 2, 2)
        fed = route[:-1]  # every token but the last was fed to the model
        assert (fed >= 0).all() and (fed < 4).all()
        assert (np.sort(fed, -1)[..., 0] != np.sort(fed, -1)[..., 1]).all()  # k distinct experts
    rows = [prompts[i] for i in out.prompt_index]

    # on the rollout's own weights: the cached decode and the whole-sequence forward route alike
    tally = ReplayTally()
    own, _, _ = policy.response_logprobs(rows, out.response_ids)
    replayed, _, _ = policy.response_logprobs(rows, out.response_ids, routes=out.routes, tally=tally)
    assert replayed.device.type == "cpu"  # results without gradients come back to the host
    assert tally.agreement == 1.0
    torch.testing.assert_close(replayed, own, rtol=0, atol=1e-6)
    assert _mean_mismatch(replayed, out.logprobs) < 1e-5

    # a perturbed router: replay brings its logprobs closer to the rollout's (CPU: 0.0062 vs 0.0145)
    perturbed = HFPolicy(moe, device=str(device), trainable=True)
    _perturb_routers(perturbed)
    unreplayed, _, _ = perturbed.response_logprobs(rows, out.response_ids)
    tally = ReplayTally()
    replayed, _, _ = perturbed.response_logprobs(rows, out.response_ids, routes=out.routes, tally=tally)
    assert 0.9 < tally.agreement < 1.0
    assert _mean_mismatch(replayed, out.logprobs) < 0.6 * _mean_mismatch(unreplayed, out.logprobs)

    # the update's gradient pass replays them too, on the device, and the routers get a gradient
    logp, _, mask = perturbed.response_logprobs(rows, out.response_ids, routes=out.routes, grad=True)
    assert logp.device.type == device.type and mask.device.type == device.type
    (-(logp * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(logp.detach().cpu(), replayed, rtol=0, atol=1e-5)
    routers = [p.grad for n, p in perturbed.model.named_parameters() if ".mlp.gate." in n]
    assert routers and all(g is not None and float(g.abs().sum()) > 0 for g in routers)


@pytest.fixture
def group_of_one(device):
    """A process group of one rank in this process: NCCL on the GPU, gloo when rehearsing."""
    from dapo_flow.core.ports import free_port

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_split_forward_gives_the_unsplit_logprobs_entropy_and_gradients(device, group_of_one):
    from dapo_flow.models import sequence_parallel as sp
    from test_sequence_parallel import TOL, _cases, _model, _split, _unsplit

    model = _model().to(device)
    on_device = lambda case: {k: v.to(device) if v is not None else None for k, v in case.items()}  # noqa: E731
    for case, chunk in zip([on_device(c) for c in _cases()] * 2, (None, None, 5, 5)):
        ref = _unsplit(model, case)
        sp.install(model, group_of_one)
        try:
            got = _split(model, case, group_of_one, chunk)
            assert model.config._attn_implementation == "ulysses_sdpa"
        finally:
            sp.uninstall(model)
        real = case["weight"] > 0
        assert got[0].device.type == device.type
        assert float((ref[0] - got[0])[real].abs().max()) <= TOL
        assert float((ref[1] - got[1])[real].abs().max()) <= TOL
        scale = max(float(g.abs().max()) for g in ref[2].values())
        assert scale > 1e-3  # gradients that are there
        assert max(float((ref[2][n] - got[2][n]).abs().max()) for n in ref[2]) <= TOL
        assert model.config._attn_implementation == "sdpa"  # the model's own attention again
