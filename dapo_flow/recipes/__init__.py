"""The built-in models' recipes: each builds one ``builtin:NAME`` model from a config and trains
it locally (``dapo_flow.models.BUILTINS`` names the builder; ``build_builtin`` caches the result).

- tiny_adder, tiny_adder_critic, tiny_adder_rm, tiny_adder_judge: a character-level Llama on the
  addition task and the critic, reward model and judge built on it;
- tiny_chat: a Qwen2 chat model with a byte-level BPE tokenizer (chat_tokenizer) on the chain task;
- tiny_agent: a model that calls the calculator tool on tool-arith;
- tiny_gym: a character-level Llama on two reasoning-gym tasks (spell_backward, letter_counting);
- warm_start: what they share: the supervised warm start, deterministic torch, the build record.
"""
