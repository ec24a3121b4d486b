"""Episodes assembled from requests, pure (no engine, no server): the continuation rules, the
loss mask, and the masked outcomes (history rewritten, request cap, budget, no model call)."""

from __future__ import annotations

import pytest

from dapo_flow.endpoint.episodes import Episode, EpisodeBook, EpisodeError, Sampled, continuation

EOS = 2
CHARS = {EOS: "</s>", 1: "<s>"}


def decode(ids: list[int]) -> str:
    """A char 'tokenizer': id 10+k is chr(ord('a')+k), id 40 is 'ab' (a merge: drift)."""
    return "".join(CHARS.get(t, "ab" if t == 40 else chr(ord("a") + t - 10)) for t in ids)


def seed_of(seed: int, k: int) -> int:
    return seed * 100 + k


def sampled(ids: list[int], truncated: bool = False) -> Sampled:
    return Sampled(ids, [-0.5] * len(ids), [3] * len(ids), truncated)


def test_continuation_rules():
    context = [1, 10, 11, EOS]
    assert continuation(context, [1, 10, 11, EOS, 12], {EOS}, decode) == [1, 10, 11, EOS, 12]
    # the text a harness got has no EOS: the sampled EOS is fed back
    assert continuation(context, [1, 10, 11, 12, 13], {EOS}, decode) == [1, 10, 11, EOS, 12, 13]
    # 'a','b' re-tokenized as the merge 'ab': the sampled ids are kept
    assert continuation([1, 10, 11], [1, 40, 12], set(), decode) == [1, 10, 11, 12]
    # an edited turn continues nothing
    assert continuation(context, [1, 10, 12, 13], {EOS}, decode) is None


def test_two_requests_are_one_sequence_with_the_inserted_tokens_masked():
    ep = Episode("e", seed=7, max_requests=4, budget=20)
    first = ep.admit([1, 10], {EOS}, decode, seed_of)
    assert first.fed == [1, 10] and first.recorded and first.seed == 700 and first.max_tokens == 20
    ep.record(first.fed, [sampled([11, EOS])])
    second = ep.admit([1, 10, 11, 14, 15], {EOS}, decode, seed_of)  # EOS dropped by the harness's text
    assert second.fed == [1, 10, 11, EOS, 14, 15] and second.seed == 701 and second.max_tokens == 20 - 4
    ep.record(second.fed, [sampled([12, EOS])])
    r = ep.result()
    assert r.prompt_ids == [1, 10]
    assert r.response_ids == [11, EOS, 14, 15, 12, EOS]
    assert r.loss_mask == [1, 1, 0, 0, 1, 1] == r.training_mask
    assert r.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert r.versions == [3] * 6 and (r.requests, r.completions, r.masked) == (2, 2, "")


def test_the_next_request_picks_the_choice_it_extends():
    ep = Episode("e", seed=0, max_requests=4, budget=20)
    ep.record(ep.admit([1], {EOS}, decode, seed_of).fed, [sampled([10, EOS]), sampled([11, EOS])])
    ep.record(ep.admit([1, 11, EOS, 13], {EOS}, decode, seed_of).fed, [sampled([12, EOS])])
    assert ep.result().response_ids == [11, EOS, 13, 12, EOS]


def test_a_rewritten_history_masks_the_sample_and_later_requests_are_not_recorded():
    book = EpisodeBook()
    book.register("e", seed=0, max_requests=8, budget=20)
    first = book.admit("e", [1, 10], {EOS}, decode, seed_of)
    book.record("e", first.fed, [sampled([11, EOS])])
    rewritten = book.admit("e", [1, 12, 13], {EOS}, decode, seed_of)
    assert not rewritten.recorded and rewritten.fed == [1, 12, 13]
    book.record("e", rewritten.fed, [sampled([14])])  # the server records only what was admitted recorded
    r = book.finish("e")
    assert r.masked == "rewritten" and r.training_mask == [0, 0] and r.response_ids == [11, EOS]
    with pytest.raises(EpisodeError) as ended:
        book.admit("e", [1, 10], {EOS}, decode, seed_of)
    assert ended.value.status == 410


def test_request_cap_budget_and_no_call():
    ep = Episode("e", seed=0, max_requests=1, budget=3)
    ep.record(ep.admit([1], {EOS}, decode, seed_of).fed, [sampled([10, 11, 12], truncated=True)])
    with pytest.raises(EpisodeError) as capped:
        ep.admit([1, 10, 11, 12], {EOS}, decode, seed_of)
    assert capped.value.status == 429 and ep.result().masked == "request_cap"

    ep = Episode("e", seed=0, max_requests=4, budget=3)
    ep.record(ep.admit([1], {EOS}, decode, seed_of).fed, [sampled([10, 11, 12], truncated=True)])
    with pytest.raises(EpisodeError) as spent:
        ep.admit([1, 10, 11, 12, 13], {EOS}, decode, seed_of)
    assert spent.value.status == 413
    r = ep.result(masked="harness_error")  # the harness raised on the 413: a truncated sample, trained
    assert r.masked == "" and r.truncated and r.response_ids == [10, 11, 12] and r.loss_mask == [1, 1, 1]

    assert Episode("e", seed=0, max_requests=4, budget=3).result().masked == "no_model_call"


def test_a_second_request_in_flight_is_refused():
    ep = Episode("e", seed=0, max_requests=4, budget=9)
    ep.admit([1], {EOS}, decode, seed_of)
    with pytest.raises(EpisodeError) as busy:
        ep.admit([1], {EOS}, decode, seed_of)
    assert busy.value.status == 409


def test_all_waiting_only_when_every_open_episode_has_its_request_held():
    """The batcher's thread rule: a call takes every thread only when no harness can run during it."""
    book = EpisodeBook()
    assert not book.all_waiting(held=4)  # no episode open: nothing to say the clients wait
    for e in ("a", "b"):
        book.register(e, seed=0, max_requests=4, budget=20)
    book.admit("a", [1], {EOS}, decode, seed_of)
    assert not book.all_waiting(held=1)  # 'b' has not sent its request: its harness may be running
    book.admit("b", [1], {EOS}, decode, seed_of)
    assert book.all_waiting(held=2)
    assert not book.all_waiting(held=1)  # one request admitted but not yet with the batcher
    book.record("a", [1], [sampled([10, EOS])])
    assert not book.all_waiting(held=2)  # 'a' got its completion: its harness runs again
    book.finish("a")
    assert book.all_waiting(held=1)  # an ended episode waits on nothing
