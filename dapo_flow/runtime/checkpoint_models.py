"""A trained model in a checkpoint: an HF directory (one unsharded worker), or sharded.

LoRA layout (``train.lora``), ``models/NAME/``: the adapters as peft saves them
(``adapter_config.json``, ``adapter_model.safetensors``), the tokenizer and ``lora_base.json``
naming the base model's directory; the base itself is the graph's `path:`.

Sharded layout, ``models/NAME/``: ``dcp/`` (torch.distributed.checkpoint: every worker of the
group writes its own shards of the weights and of the optimizer state, so neither passes
through one process), and beside it the model's config, generation config and tokenizer
(written by the first worker) and ``sharded.json``. It loads at any world size (DCP reshards),
into a group or into one unsharded worker; an HF checkpoint loads into a group too (the weights
by path, the optimizer state from ops.pt). Across nodes, the folder must be on storage every
node sees.
"""

from __future__ import annotations

import json
from pathlib import Path

SHARDED, HF, LORA = "sharded", "hf", "lora"
DCP_DIR = "dcp"
SHARDED_INFO = "sharded.json"


def checkpoint_format(path: Path) -> str:
    """How a checkpoint's model folder holds its weights: :data:`SHARDED`, :data:`LORA`
    (adapters only, in peft's format, and the base's name: dapo_flow.models.lora) or :data:`HF`."""
    from dapo_flow.models.lora import is_adapter_dir

    if (path / DCP_DIR).is_dir():
        return SHARDED
    return LORA if is_adapter_dir(path) else HF


def holds_full_weights(path: Path) -> bool:
    """Whether a checkpoint's model folder is a whole HF model (an engine can load it as it
    is); otherwise the actors built from the spec's path get the weights by a sync."""
    return checkpoint_format(path) == HF


def save_sharded_model(out: Path, policy, optimizer) -> None:
    """Every worker of the group calls this at once (``optimizer`` None: the weights only)."""
    from dapo_flow.models import fsdp

    if optimizer is not None:
        fsdp.save_sharded(out / DCP_DIR, policy.model, optimizer)
    else:
        fsdp.save_sharded_weights(out / DCP_DIR, policy.model)
    if fsdp.rank() == 0:  # what loading needs besides the weights: the architecture and tokenizer
        policy.model.config.save_pretrained(out)
        if getattr(policy.model, "generation_config", None) is not None:
            policy.model.generation_config.save_pretrained(out)
        policy.tokenizer.save_pretrained(out)
        (out / SHARDED_INFO).write_text(json.dumps({"world_size": policy.world_size,
                                                    "optimizer": optimizer is not None}))


def load_sharded_model(path: Path, policy, optimizer) -> None:
    """Load a sharded checkpoint into ``policy`` (sharded or not) and ``optimizer`` (None: the
    weights only)."""
    from dapo_flow.models import fsdp

    info = json.loads((path / SHARDED_INFO).read_text()) if (path / SHARDED_INFO).is_file() else {}
    fsdp.load_sharded(path / DCP_DIR, policy.model, optimizer if info.get("optimizer", True) else None)
