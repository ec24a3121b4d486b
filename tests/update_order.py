"""The runner's queued path (the next update queued behind the weight sync, behind the update in
flight) without Ray, and when the driver queues each update and sees each weight sync done."""

from __future__ import annotations

from dapo_flow.runtime.executors import LocalExecutor


class FakeQueueingLocalExecutor(LocalExecutor):
    """The local executor saying that its calls queue, so that the runner takes the path it
    takes on Ray (the rollout thread queues the sync and the next update); each call still runs
    when it is made."""

    queues_calls = True


def update_and_sync_order(monkeypatch) -> list[tuple[str, int]]:
    """Record ("update", version it trains) as each update is queued and ("synced", version)
    as the driver sees each weight sync done, in order."""
    from dapo_flow.runtime.loop import Runner

    events = []
    submit, finish = Runner.submit_update, Runner.finish_sync

    def submit_update(self, rollout, version):
        events.append(("update", version))
        return submit(self, rollout, version)

    def finish_sync(self, queued):
        out = finish(self, queued)
        events.append(("synced", queued.version))
        return out

    monkeypatch.setattr(Runner, "submit_update", submit_update)
    monkeypatch.setattr(Runner, "finish_sync", finish_sync)
    return events


def queued_early(events: list[tuple[str, int]]) -> list[int]:
    """The versions whose update was queued before the driver saw the sync to that version done."""
    return [v for kind, v in events if kind == "update" and ("synced", v) in events
            and events.index(("update", v)) < events.index(("synced", v))]
