"""A trained model in a checkpoint: an HF directory (one unsharded worker), or sharded.

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

SHARDED, HF = "sharded", "hf"
DCP_DIR = "dcp"
SHARDED_INFO = "sharded.json"


def checkpoint_format(path: Path) -> str:
    """How a checkpoint's model folder holds its weights: :data:`SHARDED` or :data:`HF`."""
    return SHARDED if (path / DCP_DIR).is_dir() else HF


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
