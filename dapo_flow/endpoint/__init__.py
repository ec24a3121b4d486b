"""An OpenAI-compatible endpoint in front of a rollout engine, recording token-exact episodes.

A harness (any code talking to a model over the OpenAI API: a plain ``openai`` client loop, an
agent framework) calls ``/v1/chat/completions`` or ``/v1/completions``; the server renders the
request into prompt token ids, gathers concurrent requests into batched engine calls
(:mod:`.batcher`), and records per episode (an id the harness passes as the ``X-Episode-Id``
header or the ``user`` field) the exact ids it fed and sampled, their logprobs and policy
versions (:mod:`.episodes`). A multi-request episode becomes one training sequence: the first
prompt, then every sampled token (loss mask 1) and every token the harness put in between (tool
results, user turns: loss mask 0). Training never re-tokenizes a transcript.

- :mod:`.protocol`: the request bodies (unknown fields refused) and OpenAI's error shape.
- :mod:`.render`: messages -> prompt ids (chat template, or the plain layout of the built-in
  models), tool calls parsed back in the model's call format.
- :mod:`.app`: the FastAPI routes; :mod:`.server`: the server thread, its token and address.
- :mod:`.harness`: runs a user's harness once per sample against the endpoint.
"""
