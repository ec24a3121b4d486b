"""The batcher's threads per engine call: every thread when every open episode waits on the
call, one spared for the harness clients otherwise (a fake engine that only records the count)."""

from __future__ import annotations

import torch

from dapo_flow.endpoint.batcher import Batcher, SamplingKey
from dapo_flow.endpoint.episodes import EpisodeBook, Sampled
from dapo_flow.models.sampling import Rollouts
from dapo_flow.threads import set_torch_threads

KEY = SamplingKey(n=1, temperature=1.0, top_p=1.0)


class FakeEngine:
    """Samples token 7 for every prompt and records the torch threads each call ran on."""

    weights_version = 0

    def __init__(self) -> None:
        self.threads: list[int] = []

    def generate(self, prompts, cfg) -> Rollouts:
        self.threads.append(torch.get_num_threads())
        return Rollouts.contiguous(len(prompts), 1, [[7]] * len(prompts), [[-0.1]] * len(prompts),
                                   [False] * len(prompts), 0.0)


def test_a_call_every_episode_waits_on_takes_every_thread():
    before = torch.get_num_threads()
    set_torch_threads(2)  # the process's count the batcher reads (no compute here: nothing oversubscribes)
    book, engine = EpisodeBook(), FakeEngine()
    # a batch of two closes when both came (however slowly), one waits 10 ms for an episode that may send
    batcher = Batcher(engine, spare_threads=1, expected=book.expected, all_waiting=book.all_waiting,
                      window_s=30, max_batch=2, expect_window_s=0.01)
    try:
        for e in ("a", "b"):
            book.register(e, seed=0, max_requests=4, budget=8)
        book.admit("a", [1], set(), str, lambda s, k: k)
        batcher.submit([1], KEY, 4, 0).result(timeout=30)  # 'b' has sent nothing: its harness may run
        book.record("a", [1], [Sampled([7], [-0.1], [0], False)])
        book.admit("a", [1, 7], set(), str, lambda s, k: k)
        book.admit("b", [1], set(), str, lambda s, k: k)
        waits = [batcher.submit(p, KEY, 4, 0) for p in ([1, 7], [1])]  # both episodes wait on the engine
        [w.result(timeout=30) for w in waits]
        assert engine.threads == [1, 2] and batcher.stats.all_threads == 1
        assert torch.get_num_threads() == 2  # the caller's count is its own
    finally:
        batcher.close()
        set_torch_threads(before)


def test_without_a_book_the_engine_keeps_the_count_it_was_given():
    """`dapo-flow serve`: no episodes, no spare threads: every call on the process's threads."""
    engine = FakeEngine()
    batcher = Batcher(engine)
    try:
        batcher.submit([1], KEY, 4, 0).result(timeout=30)
    finally:
        batcher.close()
    assert engine.threads == [torch.get_num_threads()] and batcher.stats.all_threads == 0
