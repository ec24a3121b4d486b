"""``builtin:tiny-adder-critic``: a PPO critic for ``builtin:tiny-adder``, initialised from it.

The policy's backbone (its decoder, as verl's critic starts from the actor's weights) under a
value head of one output per token, zero-initialised (``models.heads``): the same as
``path: builtin:tiny-adder`` with ``head: value``, built once into the cache so a graph can name
it. Nothing is trained here, so the build takes a second once tiny-adder is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo_flow.recipes import tiny_adder

# follows the policy's recipe: a new tiny-adder is a new critic
RECIPE_VERSION = 100 * tiny_adder.RECIPE_VERSION + 1


def shape_config() -> dict[str, Any]:
    """The policy's shape; the value head (hidden -> 1) replaces its output head."""
    return {**tiny_adder.shape_config(), "architectures": ["LlamaForTokenClassification"], "num_labels": 1}


def build_tiny_adder_critic(out_dir: Path, *, progress: bool = True) -> Path:
    """The critic's directory: tiny-adder's backbone and tokenizer, a zero value head."""
    import torch
    from transformers import AutoTokenizer

    from dapo_flow.models import resolve_model
    from dapo_flow.models.heads import load_torch_model
    from dapo_flow.recipes.warm_start import save_model_dir

    policy_dir = resolve_model("builtin:tiny-adder", progress=progress)
    model = load_torch_model(policy_dir, "value", torch.float32)
    save_model_dir(Path(out_dir), model, AutoTokenizer.from_pretrained(policy_dir))
    return Path(out_dir)
