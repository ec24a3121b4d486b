"""Model heads: a causal LM (`lm`: generates, gives token logprobs), a value model (`value`:
one scalar per token, a PPO critic) or a reward model (`reward`: one scalar per sequence).

A value model is Hugging Face's ``AutoModelForTokenClassification`` with one label on the
policy's architecture (``LlamaForTokenClassification``, ``Qwen2ForTokenClassification``: the
decoder plus a linear ``score`` head), as verl's critic; a reward model is
``AutoModelForSequenceClassification`` with one label (the score head read at a sequence's last
token), as verl's RM worker. Either, loaded from a causal-LM directory, keeps that model's
backbone and gets a new head initialised to zero: the critic starts at V = 0 everywhere (GAE's
first advantages are the whitened returns) and every build of it is the same bytes. Loaded from
its own kind of directory (a checkpoint, a built reward model) it keeps its head. Heavy imports
live inside functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dapo_flow.core.imports import skip_unneeded_transformers_imports

HEADS: tuple[str, ...] = ("lm", "value", "reward")
#: architecture name endings of the scalar heads, e.g. LlamaForTokenClassification
HEAD_SUFFIXES = {"value": "ForTokenClassification", "reward": "ForSequenceClassification"}
AUTO_CLASSES = {"value": "AutoModelForTokenClassification", "reward": "AutoModelForSequenceClassification"}
SCALAR_SUFFIXES = tuple(HEAD_SUFFIXES.values())


def head_of_config(config: Mapping[str, Any] | None) -> str:
    """`value` for a config.json whose architecture is a token classifier, `reward` for a
    sequence classifier, else `lm`."""
    archs = [str(a) for a in (config or {}).get("architectures") or []]
    for head, suffix in HEAD_SUFFIXES.items():
        if any(a.endswith(suffix) for a in archs):
            return head
    return "lm"


def load_torch_model(path: Path, head: str, dtype) -> Any:
    """The torch model of ``head`` from directory ``path``, in ``dtype``, on the CPU."""
    skip_unneeded_transformers_imports()
    import transformers

    if head == "lm":
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if head not in AUTO_CLASSES:
        raise ValueError(f"unknown model head {head!r}: use one of {HEADS}")
    auto = getattr(transformers, AUTO_CLASSES[head])
    config = transformers.AutoConfig.from_pretrained(path)
    new_head = head_of_config(config.to_dict()) != head or getattr(config, "num_labels", 1) != 1
    config.num_labels = 1
    # no dropout: values (the critic's targets) and their gradients must come from one function
    config.classifier_dropout = 0.0
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a new head's "newly initialized" report is expected
    try:
        model = auto.from_pretrained(path, config=config, dtype=dtype)
    finally:
        transformers.logging.set_verbosity(verbosity)
    if new_head:
        import torch

        with torch.no_grad():
            for p in value_head(model).parameters():
                p.zero_()
    return model


def value_head(model: Any) -> Any:
    """The linear layer that maps a token's hidden state to its value or reward (``score`` in HF's
    token and sequence classifiers)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no `score` or `classifier` head")
    return head
