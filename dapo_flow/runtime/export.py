"""`dapo-flow export CHECKPOINT -o DIR`: a trained model as a plain Hugging Face directory.

A checkpoint's model is an HF directory already (one unsharded worker) or sharded (a training
group: ``dcp/`` shards per worker, see ``runtime.checkpoint_models``). Export reads either
into one process, without a process group (DCP reshards to one), and writes
``save_pretrained`` safetensors, the config, generation config and tokenizer, which
``transformers``, vLLM or a graph's ``path:`` load anywhere. The directory is written beside
its destination and renamed into place: an interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path

from dapo_flow.errors import RunError
from dapo_flow.runtime import checkpoint
from dapo_flow.models.lora import is_adapter_dir
from dapo_flow.runtime.checkpoint_models import DCP_DIR, SHARDED, SHARDED_INFO, checkpoint_format


def step_folder(path: Path, flag: str) -> Path:
    """The checkpoint ``path`` names: a ``step_*`` folder, or the newest under a run's or a
    graph's folder; it must verify."""
    found = checkpoint.all_checkpoints(path) if path.is_dir() else []
    step = path if (path / checkpoint.DRIVER_FILE).is_file() else (found[-1] if found else None)
    if step is None:
        raise RunError(f"{flag} {path}: not a checkpoint (no {checkpoint.DRIVER_FILE} in it or in a step_* "
                       "folder below it); pass a step_* folder, or a run's or graph's checkpoint folder")
    problem = checkpoint.verify(step)
    if problem is not None:
        raise RunError(f"{flag} {path}: checkpoint {step} is damaged ({problem}); pass an older step_* folder")
    return step


def export(path: Path, out: Path, model: str | None = None, adapter: bool = False) -> tuple[Path, str, int]:
    """Write the checkpoint's trained ``model`` (default: its only one) to ``out`` as an HF
    directory; a LoRA-trained one merged into its base, or with ``adapter`` as the adapters in
    peft's format. Returns (the step folder read, the model, its step)."""
    step = step_folder(path, "export")
    driver = checkpoint.load_driver(step)
    trained = list(driver.trained_models)
    if model is None and len(trained) != 1:
        raise RunError(f"checkpoint {step} holds {len(trained)} trained models ({', '.join(trained)}): "
                       "pick one with --model NAME")
    model = model or trained[0]
    if model not in trained:
        raise RunError(f"--model {model}: checkpoint {step} holds {', '.join(trained)}; pick one of them")
    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"-o {out}: exists and is not an empty folder; pass a new path (nothing was written)")
    source = step / "models" / model
    lora = is_adapter_dir(source)  # LoRA's adapters (an FSDP2 group writes them beside its shards)
    if adapter and not lora:
        raise RunError(f"--adapter: model '{model}' of checkpoint {step} was trained without train.lora: "
                       "it has no adapters; leave --adapter out (the whole model is written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if lora and not adapter:
            _merge_adapters(source, staging)
        elif lora:
            _copy_adapters(source, staging)
        elif checkpoint_format(source) == SHARDED:
            _gather_sharded(source, staging)
        else:
            shutil.copytree(source, staging, dirs_exist_ok=True)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except OSError as exc:
        raise RunError(f"-o {out}: cannot write the export ({exc.strerror or exc}); free space or pick "
                       "another folder") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return step, model, driver.step


def _gather_sharded(source: Path, out: Path) -> None:
    """A sharded checkpoint's weights into one unsharded model, saved with its config and
    tokenizer files. The model is built on the meta device (no random init), then filled."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_flow.models import fsdp
    from dapo_flow.models.hf import hf_progress_bars_off

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
    model.to_empty(device="cpu")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        fsdp.load_sharded(source / DCP_DIR, model, None)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    for item in source.iterdir():  # config, generation config, tokenizer: as saved
        if item.name not in (DCP_DIR, SHARDED_INFO) and item.is_file():
            shutil.copy2(item, out / item.name)
    with hf_progress_bars_off():
        model.save_pretrained(out)
    (out / "dapo_flow_export.json").write_text(json.dumps({"from": str(source)}) + "\n")


def _merge_adapters(source: Path, out: Path) -> None:
    """A LoRA checkpoint's adapters merged into the base they name (peft's merge_and_unload),
    saved with the checkpoint's tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_flow.models.hf import hf_progress_bars_off
    from dapo_flow.models.lora import base_of

    base = base_of(source)
    if base is None or not Path(base).is_dir():
        raise RunError(f"{source}: the LoRA adapters' base model {base!r} is not a folder here; export "
                       "with --adapter (peft's format) and merge where the base is")
    with hf_progress_bars_off():
        model = AutoModelForCausalLM.from_pretrained(base)
        merged = PeftModel.from_pretrained(model, str(source)).merge_and_unload()
        merged.save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    (out / "dapo_flow_export.json").write_text(json.dumps({"from": str(source), "base": base}) + "\n")


def _copy_adapters(source: Path, out: Path) -> None:
    """The adapters in peft's format, with the tokenizer and the note naming the base (not a
    group's shards beside them)."""
    for item in source.iterdir():
        if item.is_file() and item.name != SHARDED_INFO:
            shutil.copy2(item, out / item.name)
