"""The memory estimator (dapo_flow/graph/memory.py): parameter counts against real transformers
models, and estimates against the measured peak of real training micro-batches on CPU.

Measuring: in a subprocess (this file run as a script), one per batch of cases (BATCHES), that
imports torch and transformers once and forks a process of its own for each case, so each starts
from a fresh process's state. RSS is what torch's CPU allocations show up in (malloc), so the
peak is VmHWM from /proc/self/status, reset with /proc/self/clear_refs just before the model is
built. glibc's mmap threshold is fixed at 64 KiB so freed tensors go back to the OS at once (its
default raises the threshold after the first free, keeping freed memory in the heap: that slack
is the allocator's, not the estimate's, and a GPU's caching allocator has its own). One warm-up
step of the same configuration runs first and is deleted, so one-time allocations (MKL's GEMM
buffers, ~16 MiB, kept for the process's life like cuBLAS's workspace) fall in the baseline.
docs/memory.md has the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_flow.graph.memory import (FROZEN_HEAD, FROZEN_LAYERS, GiB, LAYER_BACKWARD, LOGITS_BACKWARD,
                                    OPTIMIZER_STEP, Budget, ModelShape, Term, estimate_forward, estimate_rollout,
                                    estimate_training, lora_param_count)

REPO = Path(__file__).resolve().parents[1]

LLAMA_1M = dict(vocab_size=2000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
LLAMA_5M = dict(vocab_size=4000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
# a small vocabulary: a recomputed layer, not the logits, makes the peak under checkpointing
NARROW_VOCAB = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
# a Qwen3-MoE: 8 experts of which each token uses 2, every layer sparse
QWEN3_MOE_5M = dict(model_type="qwen3_moe", vocab_size=4000, hidden_size=256, intermediate_size=768,
                    moe_intermediate_size=192, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
LLAMA_20M = dict(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
# a vocabulary wide for the model: the logits are most of the micro-batch's memory
WIDE_VOCAB = dict(vocab_size=32000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)


# --- the measured side: runs in a subprocess (`python tests/test_memory.py '[{...}, ...]'`) ------

def _status(key: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure(args: dict) -> dict:
    """Peak bytes above the baseline of two update steps (1 micro-batch, then 2) the way
    dapo_flow/operators/update.py runs them: logits for the response positions only, float32 logprobs
    and entropy (kept through backward), the policy loss, backward, grad clip, AdamW."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from dapo_flow import algos
    from dapo_flow.models.hf import left_pad, packed_logprobs_of, positions, response_logprobs_of, right_pad

    torch.set_num_threads(1)  # small and repeatable; the suite shares the machine
    cfg = args["config"]

    def micro_batch(seed: int):
        gen = torch.Generator().manual_seed(seed)
        rows = args["rows"]
        cut = [args["pad"] and i % 2 for i in range(rows)]  # every other row 1/4 shorter: padded
        prompts = [torch.randint(1, cfg["vocab_size"], (args["prompt"] - c * args["prompt"] // 4,),
                                 generator=gen).tolist() for c in cut]
        responses = [torch.randint(1, cfg["vocab_size"], (args["response"] - c * args["response"] // 4,),
                                   generator=gen).tolist() for c in cut]
        if args["pack"]:  # train.pack: the rows as one sequence (HFPolicy's packed pass)
            from dapo_flow.models.packing import pack_rows

            packed = pack_rows(prompts, responses)
            return packed, packed.targets, packed.response_mask
        p_ids, p_mask = left_pad(prompts, 0)
        r_ids, r_mask = right_pad(responses, 0)
        mask = torch.cat([p_mask, r_mask], 1)
        return (dict(input_ids=torch.cat([p_ids, r_ids], 1), attention_mask=mask, position_ids=positions(mask)),
                r_ids, r_mask.bool())

    def build():
        torch.manual_seed(0)
        moe = cfg.get("model_type") == "qwen3_moe"  # else a Llama
        config = (Qwen3MoeConfig if moe else LlamaConfig)(**{k: v for k, v in cfg.items() if k != "model_type"},
                                                           attn_implementation="sdpa")
        model = (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(config).to(getattr(torch, args["dtype"]))
        if args["checkpointing"]:  # as HFPolicy: non-reentrant, active in train mode (no dropout)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(args["checkpointing"])
        if args["lora"]:  # as HFPolicy: peft's adapters on every linear, only they train
            from types import SimpleNamespace

            from dapo_flow.models.lora import add_adapters

            add_adapters(model, SimpleNamespace(rank=args["lora"], alpha=16.0, target_modules="all-linear",
                                                dropout=0.0), trainable=True)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step(model, opt, batches) -> None:
        opt.zero_grad(set_to_none=True)
        n_tokens = sum(int(m.sum()) for _, _, m in batches)
        for inputs, resp, resp_mask in batches:  # HFPolicy's logprob pass, chunked or not
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args["mixed_precision"])):
                if args["pack"]:
                    logp, entropy = packed_logprobs_of(model, inputs, torch.device("cpu"), with_entropy=True,
                                                       chunk_tokens=args["chunk"])
                else:
                    logp, entropy = response_logprobs_of(model, inputs, resp, resp_mask, with_entropy=True,
                                                         chunk_tokens=args["chunk"])
            adv = torch.ones(logp.shape[0], 1).expand(-1, logp.shape[1])
            loss, _ = algos.policy_loss(logp.detach() + 0.01, logp, adv, resp_mask, agg="token-mean",
                                        num_tokens=n_tokens, num_seqs=len(resp))
            if args["entropy_coef"]:  # the entropy bonus: its graph then takes part in backward
                loss = loss - args["entropy_coef"] * algos.agg_loss(
                    entropy, resp_mask, "token-mean", num_tokens=n_tokens, num_seqs=len(resp))
            loss.backward()  # `entropy` (and its graph) still alive, as in the update
            del logp, entropy, loss
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()

    batches = [micro_batch(seed) for seed in (1, 2, 3)]
    if args.get("forward"):  # a frozen model's pass (a reference's logprobs): no graph, no optimizer
        return _measure_forward(args, build, batches)
    model, opt = build()  # warm-up: one-time allocations go to the baseline
    step(model, opt, batches[:1])
    del model, opt
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = _status("VmRSS")
    model, opt = build()
    step(model, opt, batches[:1])
    step(model, opt, batches[1:])  # the 2nd micro-batch runs with gradients and AdamW state alive
    first = batches[0][0]
    tokens = int((first.input_ids if args["pack"] else first["input_ids"]).numel())
    return dict(peak=_status("VmHWM") - baseline, baseline=baseline, tokens=tokens,
                response_tokens=int(batches[0][1].numel()),
                params=sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n))


def _measure_forward(args: dict, build, batches) -> dict:
    """Peak bytes of a frozen model's logprob passes above the built model, as HFPolicy runs them
    for a reference or a judge (inference mode, one micro-batch after another): the weights are
    in the baseline, so the peak is the passes' own."""
    import gc

    import torch

    from dapo_flow.models.hf import response_logprobs_of

    def passes(model, batches) -> None:
        with torch.inference_mode():
            for inputs, resp, resp_mask in batches:
                logp, _ = response_logprobs_of(model, inputs, resp, resp_mask, chunk_tokens=args["chunk"])
                del logp

    model, _ = build()  # AdamW holds no state until a step: nothing but the weights
    model.eval()
    passes(model, batches[:1])  # warm-up: one-time allocations go to the baseline
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    passes(model, batches[1:])
    return dict(peak=_status("VmHWM") - baseline, baseline=baseline, tokens=int(batches[0][0]["input_ids"].numel()),
                response_tokens=int(batches[0][1].numel()), params=sum(p.numel() for p in model.parameters()))


def _case(config: dict, *, rows: int = 4, prompt: int = 64, response: int = 192, checkpointing: bool = False,
          pad: bool = False, dtype: str = "float32", entropy_coef: float = 0.0, chunk: int | None = None,
          mixed_precision: str | None = None, forward: bool = False, phase: str | None = None,
          within: float | None = None, lora: int = 0, pack: bool = False) -> dict:
    """What :func:`_measure` runs (and :func:`estimate` prices) for one measured case, the moment
    its estimate must peak at (None: any) and how close to the measured peak it must be (default:
    CLOSE for training, TOLERANCE for a frozen forward). ``lora``: the rank of LoRA adapters on
    every linear (0: full fine-tuning)."""
    return dict(config=config, rows=rows, prompt=prompt, response=response, checkpointing=checkpointing,
                pad=pad, dtype=dtype, entropy_coef=entropy_coef, chunk=chunk, mixed_precision=mixed_precision,
                forward=forward, phase=phase, within=within if within is not None else TOLERANCE if forward else CLOSE,
                lora=lora, pack=pack)


def measure(cases: list[dict]) -> list[dict]:
    """The peaks of ``cases``, measured one after another from one fresh subprocess (a process
    costs seconds of imports; each case is still measured in a process of its own)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", __file__, json.dumps(cases)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate(args: dict, measured: dict) -> Budget:
    """The training estimate of the settings ``args`` measured, for its measured token counts."""
    return estimate_training(ModelShape.from_config(args["config"]), micro_batch_tokens=measured["tokens"],
                             dtype=args["dtype"], mixed_precision=args["mixed_precision"],
                             entropy_in_loss=args["entropy_coef"] > 0, logprob_chunk_tokens=args["chunk"],
                             response_tokens_per_micro_batch=measured["response_tokens"],
                             grad_checkpointing=args["checkpointing"], rows_per_micro_batch=args["rows"],
                             padded=args["pad"], on_gpu=False, packed=args["pack"],
                             lora_params=lora_param_count(ModelShape.from_config(args["config"]), args["lora"],
                                                          "all-linear") if args["lora"] else 0)


def estimate_frozen(args: dict, measured: dict) -> Budget:
    """A frozen model's forward estimate of the settings ``args`` measured."""
    return Budget("forward", tuple(estimate_forward(
        ModelShape.from_config(args["config"]), micro_batch_tokens=measured["tokens"],
        response_tokens_per_micro_batch=measured["response_tokens"], rows_per_micro_batch=args["rows"],
        padded=args["pad"], compute_bytes=2 if args["dtype"] == "bfloat16" else 4,
        logprob_chunk_tokens=args["chunk"])))


needs_proc = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")


# --- parameter counts -------------------------------------------------------------------------

def _real_params(arch: str, **config) -> int:
    import transformers

    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**config))
    return sum(p.numel() for p in model.parameters())  # a tied lm_head counts once


@pytest.mark.parametrize("arch, extra", [
    ("Llama", dict(tie_word_embeddings=False)),
    ("Llama", dict(tie_word_embeddings=True)),
    ("Llama", dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    ("Qwen2", dict(tie_word_embeddings=True)),
    ("Qwen2", dict(tie_word_embeddings=False)),
    ("Mistral", dict(head_dim=16)),
])
def test_num_params_matches_transformers(arch, extra):
    config = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, **extra)
    shape = ModelShape.from_config({**config, "model_type": arch.lower()})
    assert shape.num_params() == _real_params(arch, **config)


@pytest.mark.parametrize("arch, extra", [
    ("Qwen3Moe", dict(head_dim=16)),  # every layer sparse, q/k norms
    ("Qwen2Moe", dict(shared_expert_intermediate_size=48, mlp_only_layers=[1])),  # a shared expert, a dense layer
    ("Qwen2Moe", dict(shared_expert_intermediate_size=48, decoder_sparse_step=2)),  # every second layer sparse
])
def test_total_and_active_params_of_a_mixture_of_experts_match_transformers(arch, extra):
    """Total: every expert; active: a token's top-k experts (the rest of the model whole)."""
    import transformers

    config = dict(vocab_size=300, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_experts=6,
                  num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, **extra)
    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**config))
    saved = json.loads(model.config.to_json_string())  # as config.json spells it (num_local_experts)
    shape = ModelShape.from_config(saved)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    assert shape.active_params() == shape.num_params() - experts + experts * 2 // 6


def test_tiny_moe_declares_its_shape_and_counts_before_it_is_built():
    """builtin:tiny-moe's declared shape (what `explain` reads without building it): 232,640
    parameters, 134,336 active per token (tiny-adder's 133,696 plus the routers and q/k norms)."""
    from dapo_flow.models import model_config
    from dapo_flow.recipes.tiny_moe import char_qwen3_moe, RECIPE
    from dapo_flow.models.tokenizer import build_char_tokenizer

    shape = ModelShape.from_config(model_config("builtin:tiny-moe"))
    model = char_qwen3_moe(build_char_tokenizer(model_max_length=64), RECIPE)
    assert shape.num_params() == sum(p.numel() for p in model.parameters()) == 232_640
    assert shape.active_params() == 134_336
    assert ModelShape.from_config(model_config("builtin:tiny-adder")).active_params() == 133_696  # dense: all


def test_from_config_defaults():
    shape = ModelShape.from_config(dict(vocab_size=10, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=8))
    assert (shape.head_dim, shape.num_key_value_heads, shape.tie_word_embeddings) == (8, 8, False)


def test_from_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_1M, "model_type": "llama"}))
    assert ModelShape.from_model_dir(tmp_path) == ModelShape.from_config(LLAMA_1M)


# --- arithmetic -------------------------------------------------------------------------------

def _8b() -> ModelShape:
    """Llama-3-8B's config.json numbers."""
    return ModelShape.from_config(dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192))


def test_8b_parameter_count():
    assert abs(_8b().num_params() - 8.03e9) < 0.01e9


def test_sharding_divides_state_and_offload_moves_it_to_host():
    common = dict(micro_batch_tokens=8192, response_tokens_per_micro_batch=4096, dtype="float32",
                  grad_checkpointing=True)
    one = estimate_training(_8b(), workers=1, strategy="fsdp2", **common)
    eight = estimate_training(_8b(), workers=8, **common)
    state = lambda b: {t.name.split(" (")[0]: t.bytes for t in b.terms if t.name.startswith(("param", "grad", "AdamW"))}
    assert {k: v // 8 for k, v in state(one).items()} == state(eight)
    assert state(eight)["AdamW moments"] == 2 * _8b().num_params() * 4 // 8
    off = estimate_training(_8b(), workers=8, cpu_offload=True, **common)
    assert off.peak("host") >= 4 * _8b().num_params() * 4 // 8
    assert off.total < eight.total
    # DDP: every replica holds the whole state, as one plain worker does
    ddp = estimate_training(_8b(), workers=8, strategy="ddp", **common)
    plain = estimate_training(_8b(), workers=1, strategy="none", **common)
    assert state(ddp) == state(plain) and ddp.total == plain.total


def test_checkpointing_and_bf16_shrink_activations():
    common = dict(micro_batch_tokens=16384, response_tokens_per_micro_batch=8192, workers=8)
    plain = estimate_training(_8b(), **common)
    ckpt = estimate_training(_8b(), grad_checkpointing=True, **common)
    bf16 = estimate_training(_8b(), mixed_precision="bf16", **common)
    assert ckpt.total < plain.total and bf16.total < plain.total
    act = lambda b: next(t.bytes for t in b.terms if t.name.startswith("activations"))
    assert act(ckpt) < act(plain) / 20


def test_peak_is_the_largest_moment_not_the_sum():
    budget = Budget("x", (Term("always", 10), Term("a", 5, phases=("p",)), Term("b", 7, phases=("q",)),
                          Term("c", 1, phases=("p", "q")), Term("off", 100, "host")))
    assert (budget.peak(), budget.peak_phase(), budget.biggest().name) == (18, "q", "always")
    assert budget.peak("host") == 100 and budget.rows()[-1] == ("off", 100, "host")


def test_phases_of_a_training_budget():
    budget = estimate_training(ModelShape.from_config(LLAMA_1M), micro_batch_tokens=1024,
                               response_tokens_per_micro_batch=768, on_gpu=False)
    assert set(budget.phases()) == {LOGITS_BACKWARD, LAYER_BACKWARD, OPTIMIZER_STEP}
    assert budget.peak_phase() == LOGITS_BACKWARD


def test_does_not_fit_names_the_biggest_term_and_the_fix():
    budget = estimate_training(_8b(), micro_batch_tokens=32768, response_tokens_per_micro_batch=16384,
                               workers=8, mixed_precision="bf16")
    problem = budget.fits(80 * GiB)
    assert problem is not None
    assert "activations saved for backward" in problem and "train.grad_checkpointing: true" in problem
    ckpt = estimate_training(_8b(), micro_batch_tokens=32768, response_tokens_per_micro_batch=16384,
                             workers=8, mixed_precision="bf16", grad_checkpointing=True)
    problem = ckpt.fits(16 * GiB)
    assert "logits" in problem and "train.max_tokens_per_micro_batch" in problem
    state = estimate_training(_8b(), micro_batch_tokens=1024, response_tokens_per_micro_batch=512,
                              grad_checkpointing=True)
    problem = state.fits(80 * GiB)
    assert "AdamW moments" in problem and "train.workers" in problem and "train.cpu_offload" in problem
    assert ckpt.fits(80 * GiB) is None


def test_chunked_logprobs_bound_the_logits_and_are_the_first_fix():
    common = dict(micro_batch_tokens=2 * 24576, response_tokens_per_micro_batch=2 * 20480, workers=8,
                  mixed_precision="bf16", grad_checkpointing=True, rows_per_micro_batch=2)
    shape = ModelShape.from_config(dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4))
    whole = estimate_training(shape, **common)
    problem = whole.fits(80 * GiB)
    assert "logits and their gradients" in problem and "fix: train.logprob_chunk_tokens (chunked logprobs)" in problem
    chunked = estimate_training(shape, logprob_chunk_tokens=1024, **common)
    terms = {t.name: t for t in chunked.terms}
    assert "logits kept by the entropy graph" not in terms
    # bf16 chunks take the fused path: two float32 chunk buffers and the chunk's bf16 logits (or
    # gradient) beside them, 2.5; unchunked, 4 buffers of the logits, not 5: logsumexp's own chunks
    # (110 rows of this vocabulary) are a tenth of them, and two of the 5 are its backward's temporaries
    assert terms["logits of one chunk and their gradients (float32)"].bytes == 2.5 * 1024 * 152064 * 4
    assert {t.name: t.bytes for t in whole.terms}["logits and their gradients (float32)"] == 4 * 2 * 20480 * 152064 * 4
    assert terms["logits of one chunk and their gradients (float32)"].fix == "a smaller train.logprob_chunk_tokens"
    assert chunked.total < whole.total / 2.5 and chunked.fits(80 * GiB) is None
    assert chunked.peak_phase() == LAYER_BACKWARD  # a recomputed layer: the logits are no longer the peak
    one_chunk = {t.name: t.bytes for t in estimate_training(shape, logprob_chunk_tokens=10**9, **common).terms}
    assert one_chunk["logits of one chunk and their gradients (float32)"] == 2.5 * 2 * 20480 * 152064 * 4
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        estimate_training(shape, logprob_chunk_tokens=0, **common)


def test_format_lists_every_term_in_gib():
    budget = estimate_training(_8b(), micro_batch_tokens=8192, response_tokens_per_micro_batch=4096,
                               workers=8, mixed_precision="bf16", grad_checkpointing=True, cpu_offload=True,
                               title="policy training, per worker of 8")
    text = budget.format()
    lines = text.splitlines()
    assert lines[0].startswith("policy training, per worker of 8: peak ") and " host" in lines[0]
    assert len(lines) == 1 + len(budget.terms) and all(line.count(" GiB") == 1 for line in lines[1:])
    assert len({line.index(" GiB") for line in lines[1:]}) == 1  # aligned


def test_rollout_hf_kv_cache():
    shape = _8b()
    budget = estimate_rollout(shape, dtype="bfloat16", backend="hf", max_model_len=4096, batch_rows=64)
    kv = next(t.bytes for t in budget.terms if t.name == "KV cache")
    assert kv == 64 * 4096 * 32 * 2 * 8 * 128 * 2  # rows x len x layers x (k, v) x kv heads x head_dim x bf16
    assert "KV cache" in budget.fits(40 * GiB)


def test_a_bf16_policys_rollout_holds_bf16_keys_and_values_and_autocasts_weight_copies():
    shape = _8b()
    plain = {t.name: t.bytes for t in estimate_rollout(shape, max_model_len=4096, batch_rows=64).terms}
    bf16 = {t.name: t.bytes for t in estimate_rollout(shape, max_model_len=4096, batch_rows=64,
                                                      mixed_precision="bf16").terms}
    assert bf16["KV cache"] * 2 == plain["KV cache"]  # float32 master weights, bf16 keys and values
    assert bf16["weights"] == plain["weights"] == shape.num_params() * 4
    # every projection of every layer and the lm_head, in bf16: not the embeddings or the norms
    assert shape.num_params() * 2 * 0.8 < bf16["bf16 weight copies (autocast)"] < shape.num_params() * 2
    assert "bf16 weight copies (autocast)" not in plain


def test_rollout_vllm_share_and_cpu_cache():
    gpu = estimate_rollout(_8b(), dtype="bfloat16", backend="vllm", gpu_memory_utilization=0.5,
                           gpu_mem_gib=80, max_model_len=4096, batch_rows=64)
    assert gpu.total == 40 * GiB and "gpu_memory_utilization" in gpu.fits(30 * GiB)
    cpu = estimate_rollout(ModelShape.from_config(LLAMA_1M), backend="vllm", kv_cache_gib=1.5, on_gpu=False,
                           max_model_len=512, batch_rows=8)
    assert cpu.total == 1_036_928 * 4 + 2 * GiB
    with pytest.raises(ValueError, match="gpu_mem_gib"):
        estimate_rollout(_8b(), backend="vllm", max_model_len=4096, batch_rows=1)


def test_bad_settings_are_errors():
    shape = ModelShape.from_config(LLAMA_1M)
    with pytest.raises(ValueError, match="strategy fsdp2 or ddp"):
        estimate_training(shape, micro_batch_tokens=10, response_tokens_per_micro_batch=5, workers=2, strategy="none")
    with pytest.raises(ValueError, match="cpu_offload fsdp2"):
        estimate_training(shape, micro_batch_tokens=10, response_tokens_per_micro_batch=5, workers=2,
                          strategy="ddp", cpu_offload=True)
    with pytest.raises(ValueError, match="dtype"):
        estimate_training(shape, micro_batch_tokens=10, response_tokens_per_micro_batch=5, dtype="int8")


# --- measured against real training micro-batches (CPU, float32, one worker) -------------------

# what the tests hold the estimates to: each within 10% of its measured peak, and a training
# estimate within 4% unless its case says why not
TOLERANCE = 0.10
CLOSE = 0.04
# and an absolute slack for the measurement itself: the baseline VmRSS taken at the reset may hold
# allocator pages the passes then reuse, so a peak reads 1.0-1.3 MiB lower in some runs than in
# others (every training case of the fast batch, in the test tier beside other xdist workers,
# against the same case alone; the frozen forward's read the same): on a 58 MiB peak that alone is 2%
ALLOCATOR_SLACK = 1.5 * 2**20
# every measured case: what the subprocess runs, by the id the tests name it by, and what its
# estimate must show: the moment it peaks at (where the case is about it) and how close it is
CASES = {
    "1m": _case(LLAMA_1M, phase=LOGITS_BACKWARD),
    "1m-ckpt": _case(LLAMA_1M, checkpointing=True, phase=LOGITS_BACKWARD),
    "5m-gqa-padded": _case(LLAMA_5M, pad=True),
    "narrow-ckpt": _case(NARROW_VOCAB, checkpointing=True, phase=LAYER_BACKWARD),  # a recomputed layer
    "20m": _case(LLAMA_20M),
    "20m-ckpt": _case(LLAMA_20M, checkpointing=True),
    # 2 rows of 1024 positions, one shorter: the float attention masks SDPA saves are 8 MiB a layer
    "5m-long-padded": _case(LLAMA_5M, rows=2, prompt=256, response=768, pad=True),
    "5m-long-padded-ckpt": _case(LLAMA_5M, rows=2, prompt=256, response=768, pad=True, checkpointing=True),
    # measured 1.023-1.025 alone, 1.041 once beside another xdist worker: ALLOCATOR_SLACK
    "1m-entropy": _case(LLAMA_1M, entropy_coef=0.01),
    "5m-padded-entropy": _case(LLAMA_5M, pad=True, entropy_coef=0.01),
    "1m-bf16": _case(LLAMA_1M, dtype="bfloat16"),
    # LoRA (rank 16 on every linear): the base frozen, gradients and AdamW state the adapters'.
    # Measured 4.1% over: the activations are priced as full fine-tuning's (a frozen layer
    # input needs no gradient of its own, e.g. the first layer's norms save less)
    "1m-lora": _case(LLAMA_1M, lora=16, within=0.06),
    "5m-padded-lora": _case(LLAMA_5M, pad=True, lora=16, within=0.06),
    # train.pack: the padded cases' rows packed into bins of the longest row (two of these rows
    # never fit one bin: the shorter ones leave a tail), each bin under a block-diagonal mask
    "5m-packed": _case(LLAMA_5M, pad=True, pack=True),
    "5m-long-packed": _case(LLAMA_5M, rows=2, prompt=256, response=768, pad=True, pack=True),
    "narrow-ckpt-bf16": _case(NARROW_VOCAB, dtype="bfloat16", checkpointing=True),
    # train.mixed_precision: bf16 without FSDP2: float32 weights and state, the forward under
    # torch.autocast(bf16)
    "1m-autocast": _case(LLAMA_1M, mixed_precision="bf16"),
    "narrow-ckpt-autocast": _case(NARROW_VOCAB, checkpointing=True, mixed_precision="bf16",
                                  within=0.06),  # measured 4.5-5% over
    "1m-chunk64-autocast": _case(LLAMA_1M, chunk=64, mixed_precision="bf16"),
    "5m-padded-autocast": _case(LLAMA_5M, pad=True, mixed_precision="bf16"),
    "20m-autocast": _case(LLAMA_20M, rows=2, mixed_precision="bf16"),  # 2 rows: 96 s, not 180, on AVX2
    # chunked logprobs: the fused float32 path's chunk buffers are below a layer's backward here
    "1m-chunk64": _case(LLAMA_1M, chunk=64, phase=LAYER_BACKWARD),
    "1m-chunk64-ckpt": _case(LLAMA_1M, chunk=64, checkpointing=True, phase=LAYER_BACKWARD),
    "5m-padded-chunk128": _case(LLAMA_5M, chunk=128, pad=True, phase=LOGITS_BACKWARD),
    "1m-chunk64-entropy": _case(LLAMA_1M, chunk=64, entropy_coef=0.01),
    # 32k vocabulary, 768 response tokens: the float32 logits are ~94 MiB a buffer, more than
    # logsumexp's 64 MiB chunks
    "wide": _case(WIDE_VOCAB),
    # measured 7.5% over: with the entropy only logged the fused backward holds one chunk buffer,
    # the estimate counts the forward's two (LOGITS_FUSED_BUFFERS)
    "wide-chunk128": _case(WIDE_VOCAB, chunk=128, within=0.09),
    # a frozen model's logprob passes (a reference's, a judge's), above its weights
    "forward-1m": _case(LLAMA_1M, forward=True, phase=FROZEN_HEAD),
    # a mixture of experts: weights and optimizer state of every expert, activations of a token's 2.
    # Measured 6.1% under (estimate 257.3 MiB, measured 273.9, peak at the logits' backward): HF's
    # Python loop over the experts keeps more than the per-expert input/output copies priced; not
    # located yet, so held to the 10%, not CLOSE
    "moe-5m-padded": _case(QWEN3_MOE_5M, pad=True, within=0.08),
    "forward-narrow-padded": _case(NARROW_VOCAB, pad=True, forward=True, phase=FROZEN_LAYERS),
    "forward-wide": _case(WIDE_VOCAB, forward=True, phase=FROZEN_HEAD),  # the logits are nearly all of it
    "forward-20m-chunk64": _case(LLAMA_20M, chunk=64, forward=True, phase=FROZEN_LAYERS),  # a layer's MLP
    "forward-wide-bf16-chunk64": _case(WIDE_VOCAB, dtype="bfloat16", chunk=64, forward=True, phase=FROZEN_HEAD),
    "forward-5m-bf16-16rows": _case(LLAMA_5M, dtype="bfloat16", rows=16, forward=True, phase=FROZEN_HEAD),
}
# the cases a subprocess each measures (a process costs seconds of imports; each case is still
# measured in a process of its own, forked from it): the fast ones together, the slow ones
# (bigger models, bf16 matmuls, which are slow on CPU) by what they show; each batch a test
BATCHES = {
    # one of each kind in the fast tier: plain, padded GQA, chunked logprobs, LoRA, a frozen forward
    "fast": ["1m", "5m-gqa-padded", "1m-chunk64", "1m-lora", "forward-1m"],
    "mixture-of-experts": ["moe-5m-padded"],
    "checkpointing-and-autocast": ["1m-ckpt", "narrow-ckpt", "1m-chunk64-ckpt", "1m-autocast",
                                   "5m-padded-chunk128", "forward-narrow-padded"],
    "lora-and-packing": ["5m-padded-lora", "5m-packed", "5m-long-packed"],
    "20m": ["20m", "20m-ckpt"],
    "long-padded-rows": ["5m-long-padded", "5m-long-padded-ckpt"],
    "entropy-bonus": ["1m-entropy", "5m-padded-entropy", "1m-chunk64-entropy"],
    "bfloat16": ["1m-bf16", "narrow-ckpt-bf16"],
    "autocast": ["narrow-ckpt-autocast", "1m-chunk64-autocast", "5m-padded-autocast", "20m-autocast"],
    "wide-vocabulary": ["wide", "wide-chunk128"],
    "forward": ["forward-wide", "forward-20m-chunk64", "forward-wide-bf16-chunk64", "forward-5m-bf16-16rows"],
}
assert sorted(c for batch in BATCHES.values() for c in batch) == sorted(CASES)  # every case, once


def _estimated(c: str, measured: dict) -> tuple[Budget, float]:
    """Case ``c``'s estimate for what was measured, and estimate / measured peak."""
    args = CASES[c]
    if args["forward"]:
        budget = estimate_frozen(args, measured)
        return budget, budget.peak() / measured["peak"]
    budget = estimate(args, measured)
    return budget, budget.total / measured["peak"]


# the fast batch in the fast tier, SLOW_BATCHES in the whole suite; the others (bigger models,
# bf16 matmuls: ~8 min of a core) in the figures tier, beside the other measurements docs/ prints
# (`pytest -m figures`)
SLOW_BATCHES = {"checkpointing-and-autocast", "lora-and-packing", "mixture-of-experts"}


def _tier(batch: str) -> tuple:
    if batch == "fast":
        return ()
    return (pytest.mark.slow,) if batch in SLOW_BATCHES else (pytest.mark.slow, pytest.mark.figures)


@needs_proc
@pytest.mark.parametrize("batch", [pytest.param(b, marks=_tier(b)) for b in BATCHES])
def test_estimates_match_measured(batch):
    """Each case's estimate within its precision of the measured peak (CLOSE for training,
    unless the case says why not; TOLERANCE for a frozen forward), peaking at the moment the
    case names; every case reported, the ones that miss listed first."""
    ids = BATCHES[batch]
    peaks = dict(zip(ids, measure([CASES[c] for c in ids])))
    report, missed = [], []
    for c, measured in peaks.items():
        args = CASES[c]
        budget, ratio = _estimated(c, measured)
        report.append(f"{c}: {measured['params']} params, {measured['tokens']} tokens ({measured['response_tokens']} "
                      f"response): estimate {ratio * measured['peak'] / 2**20:.1f} MiB, measured "
                      f"{measured['peak'] / 2**20:.1f} MiB, ratio {ratio:.3f}, peak at {budget.peak_phase()}")
        if measured["params"] != ModelShape.from_config(args["config"]).num_params():
            missed.append(f"{c}: the measured model has {measured['params']} parameters, the estimate's shape "
                          f"{ModelShape.from_config(args['config']).num_params()}")
        slack = 0 if args["forward"] else ALLOCATOR_SLACK  # the frozen forwards' peaks read alike
        if abs(ratio - 1) * measured["peak"] > args["within"] * measured["peak"] + slack:
            missed.append(f"{c}: ratio {ratio:.3f}, not within {args['within']:.0%} (and "
                          f"{slack / 2**20:g} MiB)\n{budget.format()}")
        if args["phase"] is not None and budget.peak_phase() != args["phase"]:
            missed.append(f"{c}: peaks at {budget.peak_phase()!r}, not {args['phase']!r}")
        if args["mixed_precision"] and "bf16 weight copies (autocast)" not in {t.name for t in budget.terms}:
            missed.append(f"{c}: no bf16 weight copies under autocast")
    print("", *report, sep="\n")  # the figures docs/memory.md quotes (shown with -s)
    assert not missed, "\n".join(missed + report)
    if batch == "wide-vocabulary":  # what chunking is for: a vocabulary large for the model
        assert peaks["wide-chunk128"]["peak"] < 0.5 * peaks["wide"]["peak"]


def test_mixed_precision_without_fsdp2_keeps_float32_state():
    common = dict(micro_batch_tokens=16384, response_tokens_per_micro_batch=8192)
    for strategy, workers in (("none", 1), ("ddp", 8)):
        plain = estimate_training(_8b(), strategy=strategy, workers=workers, **common)
        mixed = estimate_training(_8b(), strategy=strategy, workers=workers, mixed_precision="bf16", **common)
        state = lambda b: {t.name: t.bytes for t in b.terms if t.name in ("parameters", "gradients", "AdamW moments")}
        assert state(mixed) == state(plain) and state(mixed)["parameters"] == _8b().num_params() * 4
        copies = next(t for t in mixed.terms if t.name == "bf16 weight copies (autocast)")
        assert _8b().num_params() * 2 * 0.9 < copies.bytes < _8b().num_params() * 2  # not the embeddings
        assert mixed.total < plain.total
        act = lambda b: next(t.bytes for t in b.terms if t.name.startswith("activations"))
        assert act(mixed) < act(plain)
    sharded = estimate_training(_8b(), workers=8, dtype="bfloat16", mixed_precision="bf16", **common)
    assert not any("autocast" in t.name for t in sharded.terms)  # FSDP2's own policy


@pytest.mark.parametrize("strategy, workers", [("none", 1), ("ddp", 8), ("fsdp2", 8)])
def test_mixed_precision_budgets_float32_master_state_whatever_the_dtype(strategy, workers):
    """Under mixed_precision: bf16 the trained copy holds float32 parameters, gradients and AdamW
    moments (4 bytes each) whatever the model's dtype, which is then only the other copies'; the
    computed values are bf16 either way, so the budget is the float32 model's."""
    common = dict(micro_batch_tokens=16384, response_tokens_per_micro_batch=8192, strategy=strategy,
                  workers=workers, mixed_precision="bf16")
    bf16 = estimate_training(_8b(), dtype="bfloat16", **common)
    assert bf16.terms == estimate_training(_8b(), dtype="float32", **common).terms
    shard = workers if strategy == "fsdp2" else 1
    state = {t.name.split(" (")[0]: t.bytes for t in bf16.terms}
    assert state["parameters"] == state["gradients"] == _8b().num_params() * 4 // shard
    assert state["AdamW moments"] == 2 * _8b().num_params() * 4 // shard
    plain = {t.name.split(" (")[0]: t.bytes for t in
             estimate_training(_8b(), dtype="bfloat16", **{**common, "mixed_precision": None}).terms}
    assert plain["parameters"] == _8b().num_params() * 2 // shard  # no mixed precision: dtype throughout
    assert ("bf16 weight copies" in state) == (strategy != "fsdp2")  # autocast's, not FSDP2's


def test_a_chunked_frozen_forward_bounds_the_logits_of_a_wide_vocabulary():
    shape = ModelShape.from_config(dict(WIDE_VOCAB, vocab_size=152064))
    kw = dict(micro_batch_tokens=64 * 4096, response_tokens_per_micro_batch=64 * 3072, rows_per_micro_batch=64)
    whole = Budget("f", tuple(estimate_forward(shape, **kw)))
    chunked = Budget("f", tuple(estimate_forward(shape, logprob_chunk_tokens=1024, **kw)))
    assert whole.peak() > 100 * GiB and whole.biggest().fix.startswith("train.logprob_chunk_tokens")
    assert chunked.peak() < whole.peak() / 10 and chunked.peak_phase() == FROZEN_LAYERS
    with pytest.raises(ValueError, match="response tokens"):
        estimate_forward(shape, micro_batch_tokens=10, response_tokens_per_micro_batch=20)


def _measure_each(settings: list[dict]) -> list[dict]:
    """:func:`_measure` of each case in a process of its own, forked from this one once the imports
    are done: each starts from a fresh process's state (what an earlier case freed or cached is
    not there to be reused), without paying the imports again."""
    import torch  # noqa: F401  the imports the measuring processes share, and nothing run yet
    from transformers import LlamaForCausalLM  # noqa: F401  (transformers loads it lazily)

    from dapo_flow import algos  # noqa: F401
    from dapo_flow.models import hf  # noqa: F401

    results = []
    for args in settings:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one case, its result (or traceback) through the pipe
            os.close(read)
            code = 0
            try:
                out = json.dumps(_measure(args))
            except BaseException:
                import traceback

                out, code = traceback.format_exc(), 1
            with os.fdopen(write, "w") as pipe:
                pipe.write(out)
            os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            out = pipe.read()
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            raise RuntimeError(f"measuring {args} failed:\n{out}")
        results.append(json.loads(out))
    return results


if __name__ == "__main__":  # the measuring subprocess: a JSON list of cases in, their peaks out
    print(json.dumps(_measure_each(json.loads(sys.argv[1]))))
