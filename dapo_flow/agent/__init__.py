"""Multi-turn, tool-using rollout (the `agent-generate` operator's machinery).

Each sample is a request that moves through a state machine (:mod:`.requests`)::

    PENDING -> RUNNING -> TOOL_CALLING -> RUNNING -> ... -> COMPLETED

:mod:`.rollout` drives every request of a batch in rounds: all RUNNING requests' next turns
go to the engine in ONE call (turns of different requests batch together), then every call of
every TOOL_CALLING request runs at once in threads (:mod:`.tool_runner`, a timeout each). A
tool's response goes back into the conversation as tokens (:mod:`.observations`) that the
loss never trains on (``loss_mask`` 0); the tokens trained on are exactly those the engine
produced, never a re-tokenization of decoded text. A request ends with a final answer (a turn
that calls no tool), at ``max_turns``, when the response token budget runs out, or when a
tool that is an environment (:mod:`dapo_flow.envs`) says its episode is done.
"""
