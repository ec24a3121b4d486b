"""Model heads: a causal LM (`lm`: generates, gives token logprobs) or a value model (`value`:
one scalar per token, a PPO critic).

A value model is Hugging Face's ``AutoModelForTokenClassification`` with one label on the
policy's architecture (``LlamaForTokenClassification``, ``Qwen2ForTokenClassification``: the
decoder plus a linear ``score`` head), as verl's critic. Loaded from a causal-LM directory it
keeps that model's backbone and gets a new head, initialised to zero, so the critic starts at
V = 0 everywhere (GAE's first advantages are the whitened returns) and every build of it is the
same bytes; loaded from a value model's directory (a critic checkpoint) it keeps its head.
Heavy imports live inside functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

HEADS: tuple[str, ...] = ("lm", "value")
VALUE_SUFFIXES = ("ForTokenClassification",)  # e.g. LlamaForTokenClassification


def head_of_config(config: Mapping[str, Any] | None) -> str:
    """`value` for a config.json whose architecture is a token classifier, else `lm`."""
    archs = (config or {}).get("architectures") or []
    return "value" if any(str(a).endswith(VALUE_SUFFIXES) for a in archs) else "lm"


def load_torch_model(path: Path, head: str, dtype) -> Any:
    """The torch model of ``head`` from directory ``path``, in ``dtype``, on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if head == "lm":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if head != "value":
        raise ValueError(f"unknown model head {head!r}: use one of {HEADS}")
    config = AutoConfig.from_pretrained(path)
    new_head = head_of_config(config.to_dict()) != "value" or getattr(config, "num_labels", 1) != 1
    config.num_labels = 1
    # no dropout: values (the critic's targets) and their gradients must come from one function
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    if new_head:
        import torch

        with torch.no_grad():
            for p in value_head(model).parameters():
                p.zero_()
    return model


def value_head(model: Any) -> Any:
    """The linear layer that maps a token's hidden state to its value (``score`` in HF's token
    classifiers)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no `score` or `classifier` head")
    return head
