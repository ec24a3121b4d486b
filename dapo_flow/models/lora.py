"""LoRA adapters on a policy's torch model, through `peft` (``models.X.train.lora``).

The adapters are injected into the HF model in place (:func:`peft.inject_adapter_in_model`),
so the model keeps its class, its submodule paths and everything else that reads it; only a
targeted linear's weight moves to ``<module>.base_layer.weight`` beside its ``lora_A`` /
``lora_B``. Only the adapters train: gradients, AdamW state and DDP/FSDP2 gradient traffic are
the adapters' alone.

What leaves the trainer is the merged model (:func:`merged_weights`, every weight under its
base name, ``W + scaling * B @ A`` for an adapted one), so a rollout engine (a frozen hf copy,
vLLM) loads it as it loads any weight sync: nothing there knows about LoRA. A checkpoint holds
the adapters only, in peft's format, plus a note naming the base (:func:`save_adapters`); a
reference model on the same weights is the base with the adapters switched off
(:func:`adapters_disabled`), not a second copy.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # torch is imported where a tensor is touched: the checkpoint-format helpers
    import torch  # below serve the CLI, which starts without it

ADAPTER = "default"  # peft's name for the one adapter a policy has
ADAPTER_CONFIG = "adapter_config.json"  # peft's file: its presence marks a LoRA checkpoint
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_NOTE = "lora_base.json"  # the base model's directory, which the adapters apply to
PEFT_PREFIX = "base_model.model."  # peft's key prefix in adapter files (a PeftModel's attribute path)
BASE_LAYER = ".base_layer"


def lora_config(settings: Any, base: str | None = None):
    """The :class:`peft.LoraConfig` of ``settings`` (``train.lora``: rank, alpha,
    target_modules, dropout)."""
    from peft import LoraConfig

    targets = settings.target_modules
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      bias="none", base_model_name_or_path=base)


def add_adapters(model: torch.nn.Module, settings: Any, *, trainable: bool) -> None:
    """Inject LoRA adapters into ``model`` (in place). ``trainable``: only the adapters take
    gradients, held in float32 whatever the base's dtype; else nothing does. Fresh adapters
    change nothing: ``lora_B`` starts at zero."""
    import torch
    from peft import inject_adapter_in_model

    model.requires_grad_(False)
    training = model.training
    try:
        inject_adapter_in_model(lora_config(settings), model)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"train.lora.target_modules: {exc}") from None
    model.train(training)  # new modules come in train mode: the adapters' dropout would be on everywhere
    if trainable:  # float32 adapters over a half-precision base: they are the master weights
        for name, param in model.named_parameters():
            param.requires_grad_(".lora_" in name)
            if ".lora_" in name and param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()


def _is_adapted(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def base_name(name: str) -> str:
    """A state-dict key of the adapted model as the plain model names it
    (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    return name.replace(BASE_LAYER + ".", ".")


def merged_weights(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the merged model under its base name, in state-dict order: an adapted
    linear's ``W + scaling * B @ A`` (computed in float32, returned in W's dtype; a new tensor),
    any other weight as it is. ``full`` turns a stored tensor into its full value (a DTensor's
    all-gather: the same calls in the same order on every worker of a group)."""
    state = model.state_dict()
    for name, value in state.items():
        if ".lora_" in name:
            continue
        if not name.endswith(BASE_LAYER + ".weight"):
            yield base_name(name), full(value)
            continue
        path = name[: -len(BASE_LAYER + ".weight")]
        layer = model.get_submodule(path)
        a = full(state[f"{path}.lora_A.{ADAPTER}.weight"]).float()  # (r, in)
        b = full(state[f"{path}.lora_B.{ADAPTER}.weight"]).float()  # (out, r)
        weight = full(value)
        delta = (b @ a) * layer.scaling[ADAPTER]  # (out, in)
        yield base_name(name), (weight.float() + delta).to(weight.dtype)


def merged_manifest_pairs(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(base name, the stored tensor of that shape) for each weight :func:`merged_weights`
    yields, without computing anything (a weight sync's plan)."""
    return [(base_name(n), v) for n, v in model.state_dict().items() if ".lora_" not in n]


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model for the block: every adapter switched off (a reference model's
    logprobs), on again after."""
    layers = [m for m in model.modules() if _is_adapted(m)]
    flags = {p: p.requires_grad for p in model.parameters()}  # peft's switch sets them: put them back
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in flags.items():
            param.requires_grad_(flag)


@contextmanager
def dropout_active(model: torch.nn.Module) -> Iterator[None]:
    """The adapters' dropout on for a gradient pass (the model itself stays in eval mode: it
    has no dropout of its own in RL, and rollout and logprobs run without any)."""
    drops = [m.lora_dropout[ADAPTER] for m in model.modules() if _is_adapted(m)]
    for d in drops:
        d.train()
    try:
        yield
    finally:
        for d in drops:
            d.eval()


def adapter_state(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                  ) -> dict[str, torch.Tensor]:
    """The adapters' weights under peft's file keys (``base_model.model.<path>.lora_A.weight``),
    on the host in float32."""
    import torch

    out = {}
    for name, value in model.state_dict().items():
        if ".lora_" in name:
            key = PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")
            out[key] = full(value).detach().to("cpu", torch.float32).contiguous()
    return out


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights (:func:`adapter_state`'s keys) into ``model``'s adapters; every
    adapter must come, and nothing else."""
    import torch

    params = dict(model.state_dict())
    wanted = {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): n for n in params if ".lora_" in n}
    missing, unexpected = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
    if missing or unexpected:
        raise ValueError(f"adapter weights do not match the model's adapters (rank or target_modules "
                         f"changed?): missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for key, name in wanted.items():
            target = params[name]
            if tuple(target.shape) != tuple(state[key].shape):
                raise ValueError(f"adapter weight {key}: shape {tuple(state[key].shape)} != the model's "
                                 f"{tuple(target.shape)} (train.lora.rank changed?)")
            target.copy_(state[key])


def save_adapters(out: Path, state: dict[str, torch.Tensor], settings: Any, base: Path) -> None:
    """A peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``: what
    ``PeftModel.from_pretrained(base, out)`` loads) and a note naming ``base``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    lora_config(settings, base=str(base)).save_pretrained(str(out))
    save_file(state, str(out / ADAPTER_WEIGHTS))
    (out / BASE_NOTE).write_text(json.dumps({"base": str(base)}))


def read_adapters(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / ADAPTER_WEIGHTS))


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def base_of(path: Path) -> str | None:
    """The base model an adapter directory applies to, as written when it was saved."""
    note = path / BASE_NOTE
    if note.is_file():
        return json.loads(note.read_text())["base"]
    config = path / ADAPTER_CONFIG
    return json.loads(config.read_text()).get("base_model_name_or_path") if config.is_file() else None


def trainable_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
