"""A stand-in for a judge behind an API (benchmarks/reward_server.py): each verdict waits
JUDGE_S, as a call to a remote model would, then checks the answer. No imports of the
benchmark's own, so `dapo-flow serve-reward benchmarks/_judge.py:judge` loads it alone."""

import time

JUDGE_S = 0.005  # a fast judge API's latency; the wait releases the GIL, as a socket's does


def judge(text: str, truth: str, extra: dict) -> float:
    time.sleep(JUDGE_S)
    return 1.0 if truth in text else -1.0
