"""Weight sync trainer -> vLLM rollout engine: the streamed path against the disk path and a floor.

What it times: after every update dapo-flow copies the trainer's weights (an
``HFPolicy``) into the rollout engine (a ``VLLMGenerator``, in-process, tensor_parallel 1). One
sync, three ways, in one process and one run:

- new (streamed): ``gen.load_weights(policy.iter_weights())``: (name, tensor) pairs, views of the
  trainer's own weights, streamed into the in-process worker's ``reload_weights``; no file, no
  copy of the model.
- old (disk): the disk path an earlier version used, reproduced as it was
  (``VLLMGenerator.load_weights`` of commit b0bb795, and still ``_load_through_disk`` for
  tensor-parallel engines):
  ``policy.named_weights()`` (float32 numpy copies of every weight, ``lm_head.weight`` included
  when tied) -> ``safetensors.numpy.save_file`` into the engine's sync directory (a staging name,
  then ``os.replace``) -> ``collective_rpc("reload_weights", weights_path=DIR)`` ->
  ``reset_prefix_cache()``.
- floor: one in-memory copy of the weights, ``t.clone()`` of each ``state_dict`` tensor, the
  tied embedding once (``state_dict`` lists it twice, one storage), then dropped: every sync
  reads and writes each weight at least once.

Per path: seconds (median over interleaved repetitions, order rotated every repetition, each
path run once untimed first), ``ratio_to_floor`` (median / floor median, same run), and peak
extra memory: a background thread reads VmRSS and RssAnon from /proc/self/status every ~2 ms
during the sync; peak minus the value just before (after ``gc.collect()`` and glibc
``malloc_trim(0)``, so memory freed by an earlier repetition and kept by malloc cannot hide an
allocation), the largest over the repetitions. VmRSS counts file pages the process maps (the
disk path's loader reads the safetensors file through mmap); RssAnon is allocations only.
Reported in bytes, MiB and as a multiple of the model's bytes (unique parameters; tied
embeddings once). Targets: streamed <= 2x the floor in time, and peak extra <=
2 "buckets" (here about one tensor, the largest: the embedding, since pairs come one at a time).
Also printed: the anon memory still held right after the sync (before the trim: glibc keeps
freed heap chunks), and one more streamed sync with vLLM's per-layer processing and its oneDNN
weight prepacking timed inside (``new_path_parts``), to say where the time over the floor goes.

Correctness: before every sync of the old and new paths (untimed) the trainer's weights are
perturbed (Gaussian noise of 0.1x each tensor's std, every tensor, biases and norms included),
so a sync that skipped weights or did nothing would show: after the sync the engine's greedy
completions of a few prompts must equal HFPolicy's (a mismatch at a near-tie, where HF's own
logits differ by < 1e-4 between the two tokens, is counted, not failed). The engine's answers
before the sync are compared too (``stale_differs``: the check is not vacuous).

Model: a Qwen2 architecture (Qwen2.5-0.5B's shapes: hidden 896, 24 layers, 14 heads / 2 KV heads,
head_dim 64, intermediate 4864, vocab 151936, tied embeddings; max_position_embeddings cut to 512
so vLLM's default max_model_len stays small), random init (seed 0), float32, saved with
save_pretrained in a temp dir with dapo-flow's character tokenizer (ids 0-17; the other ids of
the vocabulary are never prompted and decode to nothing, which nothing here needs). ``--quick``:
hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 1024, same vocab (~43M parameters).

Run: python benchmarks/weight_sync.py [--quick] [--json [PATH]] [--reps R] [--threads N] [--dtype D]
``--json`` alone prints one JSON object on stdout (everything else goes to stderr);
``--json PATH`` writes it to PATH as the other scripts do. Torch threads: 1 by default
(``dapo_flow.threads.configure``): the copies are memory-bound and the box is shared.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import LoadSampler, fmt, make_console, random_qwen2, write_json

PATHS = ("floor", "new", "old")
PROMPTS = ["1+2=", "37+45=", "999+1=", "12-3=", "7 7 7"]
MAX_TOKENS = 8
NEAR_TIE = 1e-4  # HF logit gap under which a differing greedy token is a tie, not a bad sync

FULL = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
            intermediate_size=4864, vocab_size=151936)  # Qwen2.5-0.5B
QUICK = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024, vocab_size=151936)


# ------------------------------------------------------------------------------ memory sampling

_STATUS_KEYS = (b"VmRSS:", b"RssAnon:")


def read_rss() -> tuple[int, int]:
    """(VmRSS, RssAnon) of this process in bytes."""
    with open("/proc/self/status", "rb") as f:
        data = f.read()
    out = []
    for key in _STATUS_KEYS:
        at = data.index(key) + len(key)
        out.append(int(data[at:data.index(b"kB", at)]) * 1024)
    return out[0], out[1]


_libc = ctypes.CDLL("libc.so.6")


def settle() -> None:
    """Give memory freed by earlier work back to the OS before a baseline is read."""
    gc.collect()
    _libc.malloc_trim(0)


class PeakRSS:
    """Peak VmRSS / RssAnon above the value at entry, sampled every ``every_s`` by a thread."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take()
            time.sleep(self.every_s)

    def _take(self) -> None:
        rss, anon = read_rss()
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
        self.samples += 1

    def __enter__(self) -> "PeakRSS":
        self.base_rss, self.base_anon = read_rss()
        self.peak_rss, self.peak_anon = self.base_rss, self.base_anon
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()  # the end state counts too

    @property
    def extra_rss(self) -> int:
        return self.peak_rss - self.base_rss

    @property
    def extra_anon(self) -> int:
        return self.peak_anon - self.base_anon


# ------------------------------------------------------------------------------ model

def build_model(out_dir: Path, shape: dict, dtype: str, console) -> dict:
    """A random-init (seed 0) Qwen2 causal LM of ``shape`` saved with the character tokenizer
    (``_common.random_qwen2``); returns its info."""
    from dapo_flow.models.tokenizer import build_char_tokenizer

    start = time.perf_counter()
    info = random_qwen2(out_dir, shape, build_char_tokenizer(model_max_length=512), dtype=dtype,
                        max_positions=512)
    info["build_seconds"] = time.perf_counter() - start
    settle()
    console.print(f"built {info['num_parameters'] / 1e6:.1f}M-parameter Qwen2 ({dtype}, "
                  f"{info['model_bytes'] / 2**20:,.0f} MiB) in {info['build_seconds']:.1f} s")
    return info


# ------------------------------------------------------------------------------ the three syncs

def sync_new(policy, gen) -> None:
    gen.load_weights(policy.iter_weights())


def sync_old(policy, gen) -> None:
    """The disk path as ``VLLMGenerator.load_weights(policy.named_weights())`` ran it at
    commit b0bb795."""
    import numpy as np
    from safetensors.numpy import save_file

    weights = policy.named_weights()
    sync_dir = Path(gen._sync_dir.name)
    staging = sync_dir / "model.safetensors.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(staging))
    os.replace(staging, sync_dir / "model.safetensors")
    gen.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(sync_dir)})
    gen.llm.reset_prefix_cache()


def sync_floor(policy, gen) -> None:
    """One copy of every weight, tied tensors once (``state_dict`` names the tied embedding twice:
    ``model.embed_tokens.weight`` and ``lm_head.weight``, one storage)."""
    seen, copy = set(), {}
    for name, t in policy.model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            copy[name] = t.clone()
    del copy


SYNCS = {"floor": sync_floor, "new": sync_new, "old": sync_old}


# ------------------------------------------------------------------------------ correctness

class Checker:
    """Perturbs the trainer, and compares the engine's greedy completions with the trainer's."""

    def __init__(self, policy, gen):
        from dapo_flow.models.sampling import SamplingConfig

        self.policy, self.gen = policy, gen
        self.prompts = [policy.tokenizer(p)["input_ids"] for p in PROMPTS]
        self.cfg = SamplingConfig(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
        self.step = 0
        self.near_ties = 0
        self.stale_differs = 0
        self.checks = 0
        self.max_logprob_diff = 0.0

    def perturb(self) -> None:
        import torch

        self.step += 1
        g = torch.Generator().manual_seed(1000 + self.step)
        with torch.no_grad():
            for p in self.policy.model.parameters():
                scale = 0.1 * max(float(p.float().std()) if p.numel() > 1 else 0.0, 0.02)
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype), alpha=scale)

    def before(self):
        """Perturb, then the engine's (stale) answers and the trainer's new ones."""
        self.perturb()
        expected = self.policy.generate(self.prompts, self.cfg)
        if self.gen.generate(self.prompts, self.cfg).response_ids != expected.response_ids:
            self.stale_differs += 1
        return expected

    def after(self, expected, label: str) -> None:
        self.checks += 1
        got = self.gen.generate(self.prompts, self.cfg)
        for prompt, want, have, want_lp, have_lp in zip(self.prompts, expected.response_ids, got.response_ids,
                                                        expected.logprobs, got.logprobs):
            if want == have:
                self.max_logprob_diff = max([self.max_logprob_diff] + [abs(a - b) for a, b in zip(want_lp, have_lp)])
                continue
            at = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            if at < min(len(want), len(have)) and self._gap(prompt + want[:at], want[at], have[at]) < NEAR_TIE:
                self.near_ties += 1
                continue
            raise SystemExit(f"{label} sync: engine's greedy completion {have} != trainer's {want} "
                             f"(prompt {prompt}, first difference at token {at})")

    def _gap(self, ids: list[int], a: int, b: int) -> float:
        import torch

        with torch.inference_mode():
            logits = self.policy.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        return abs(float(logits[a] - logits[b]))


# ------------------------------------------------------------------------------ measurement

def measure(policy, gen, reps: int, console) -> dict:
    checker = Checker(policy, gen)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    extra_rss: dict[str, list[int]] = {p: [] for p in PATHS}
    extra_anon: dict[str, list[int]] = {p: [] for p in PATHS}
    samples: dict[str, list[int]] = {p: [] for p in PATHS}
    retained: dict[str, list[int]] = {p: [] for p in PATHS}

    def one(path: str, timed: bool) -> None:
        expected = checker.before() if path != "floor" else None
        settle()
        with PeakRSS() as mem:
            start = time.perf_counter()
            SYNCS[path](policy, gen)
            seconds = time.perf_counter() - start
        held = read_rss()[1] - mem.base_anon  # before trimming: what malloc keeps after this sync
        settle()
        kept = read_rss()[1] - mem.base_anon  # after: what the sync really left allocated
        if expected is not None:
            checker.after(expected, path)
        if timed:
            times[path].append(seconds)
            extra_rss[path].append(mem.extra_rss)
            extra_anon[path].append(mem.extra_anon)
            samples[path].append(mem.samples)
            retained[path].append(held)
        console.print(f"[dim]  {path:5s} {'timed ' if timed else 'warm-up'} {seconds:7.3f} s, "
                      f"peak extra RSS {mem.extra_rss / 2**20:8.1f} MiB (anon {mem.extra_anon / 2**20:8.1f}), "
                      f"anon after {held / 2**20:6.1f} MiB ({kept / 2**20:5.1f} after malloc_trim), "
                      f"{mem.samples} samples[/]")

    for path in PATHS:
        one(path, timed=False)
    for rep in range(reps):  # interleaved, order rotated: a busy minute hits every path
        order = PATHS[rep % len(PATHS):] + PATHS[:rep % len(PATHS)]
        for path in order:
            one(path, timed=True)
    return {"times": times, "extra_rss": extra_rss, "extra_anon": extra_anon, "samples": samples,
            "retained": retained,
            "checks": checker.checks, "near_ties": checker.near_ties, "stale_differs": checker.stale_differs,
            "max_logprob_diff": checker.max_logprob_diff}


def new_path_parts(policy, gen) -> dict:
    """One more streamed sync with vLLM's per-layer steps timed (wrapped, for accounting only):
    ``_layerwise_process`` (materialize a fresh copy of the layer, load the buffered weights into
    it, process it, copy it back into the engine's own tensors) and, inside it, the CPU GEMM
    weight prepacking (``create_onednn_mm``: process_weights_after_loading builds a new packed copy
    of each linear weight, the tied embedding included, for oneDNN)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.model_loader.reload import layerwise

    spent = {"layerwise_process_s": 0.0, "onednn_prepack_s": 0.0, "onednn_prepacks": 0,
             "onednn_prepack_s_by_shape": {}}
    orig_pack, orig_process = ops.create_onednn_mm, layerwise._layerwise_process

    def pack(*a, **k):
        start = time.perf_counter()
        try:
            return orig_pack(*a, **k)
        finally:
            took = time.perf_counter() - start
            spent["onednn_prepack_s"] += took
            spent["onednn_prepacks"] += 1
            shape = "x".join(map(str, a[0].shape))
            by_shape = spent["onednn_prepack_s_by_shape"]
            by_shape[shape] = by_shape.get(shape, 0.0) + took

    def process(*a, **k):
        start = time.perf_counter()
        try:
            return orig_process(*a, **k)
        finally:
            spent["layerwise_process_s"] += time.perf_counter() - start

    ops.create_onednn_mm, layerwise._layerwise_process = pack, process
    try:
        settle()
        start = time.perf_counter()
        sync_new(policy, gen)
        spent["total_s"] = time.perf_counter() - start
    finally:
        ops.create_onednn_mm, layerwise._layerwise_process = orig_pack, orig_process
    return spent


def summarize(raw: dict, model_bytes: int) -> dict:
    floor = statistics.median(raw["times"]["floor"])
    out = {}
    for path in PATHS:
        sec = statistics.median(raw["times"][path])
        peak, anon = max(raw["extra_rss"][path]), max(raw["extra_anon"][path])
        out[path] = {
            "seconds": sec, "seconds_min": min(raw["times"][path]), "seconds_all": raw["times"][path],
            "floor_seconds": floor, "ratio_to_floor": sec / floor,
            "peak_extra_bytes": peak, "peak_extra_model_multiple": peak / model_bytes,
            "peak_extra_anon_bytes": anon, "peak_extra_anon_model_multiple": anon / model_bytes,
            "peak_extra_bytes_all": raw["extra_rss"][path], "rss_samples": raw["samples"][path],
            "anon_held_after_bytes": max(raw["retained"][path]),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~43M-parameter model, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="timed syncs per path (default 3, quick 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="trainer and engine dtype (default float32)")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print the results as one JSON object on stdout, or write them to PATH")
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 3)

    json_stdout = args.json == "-"
    if json_stdout:  # keep stdout for the JSON: everything else (vLLM's logs too) to stderr
        out_fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = os.fdopen(os.dup(2), "w", buffering=1)
    console = make_console()

    from dapo_flow import threads

    threads.configure(args.threads)
    shape = QUICK if args.quick else FULL
    mem_available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    console.print(f"available memory at start: {mem_available / 2**30:.1f} GiB; load {os.getloadavg()[0]:.2f}")

    with tempfile.TemporaryDirectory(prefix="dapo-flow-weight-sync-") as tmp:
        model_dir = Path(tmp) / "model"
        info = build_model(model_dir, shape, args.dtype, console)

        from dapo_flow.models.hf import HFPolicy
        from dapo_flow.models.vllm_engine import VLLMGenerator

        start = time.perf_counter()
        policy = HFPolicy(model_dir, dtype=args.dtype, trainable=True)
        gen = VLLMGenerator(model_dir, dtype=args.dtype, kv_cache_gib=1)
        threads.configure(args.threads)  # vLLM's worker no-ops torch.set_num_threads; set it for real
        startup = time.perf_counter() - start
        console.print(f"HFPolicy + VLLMGenerator up in {startup:.1f} s; {reps} timed syncs per path")

        with LoadSampler() as load:
            raw = measure(policy, gen, reps, console)
            parts = new_path_parts(policy, gen)
        gen.close()

    res = summarize(raw, info["model_bytes"])
    from rich.table import Table

    mb = info["model_bytes"]
    t = Table(title=f"weight sync, {info['num_parameters'] / 1e6:.0f}M-parameter Qwen2 {args.dtype} "
                    f"({mb / 2**20:,.0f} MiB; largest tensor {info['largest_tensor_bytes'] / 2**20:,.0f} MiB)")
    for col in ("path", "seconds (median)", "min", "vs floor", "peak extra RSS MiB", "x model",
                "peak extra anon MiB", "x model"):
        t.add_column(col, justify="right")
    for path in ("old", "new", "floor"):
        r = res[path]
        t.add_row(path, f"{r['seconds']:.3f}", f"{r['seconds_min']:.3f}", f"{r['ratio_to_floor']:.2f}x",
                  f"{r['peak_extra_bytes'] / 2**20:,.1f}", f"{r['peak_extra_model_multiple']:.2f}",
                  f"{r['peak_extra_anon_bytes'] / 2**20:,.1f}", f"{r['peak_extra_anon_model_multiple']:.2f}")
    console.print(t)
    ties = f", {raw['near_ties']} near-tie differences" if raw["near_ties"] else ""
    console.print(f"correctness: {raw['checks']} syncs checked against the trainer's greedy completions "
                  f"({len(PROMPTS)} prompts x {MAX_TOKENS} tokens): all equal{ties}; the engine's "
                  f"answers before the sync differed in {raw['stale_differs']}/{raw['checks']}; greedy-token "
                  f"logprobs engine vs trainer within {raw['max_logprob_diff']:.1e}")
    console.print(f"new path parts (one more sync, timed inside vLLM): {parts['total_s']:.3f} s in all, "
                  f"{parts['layerwise_process_s']:.3f} s in layerwise processing, of which "
                  f"{parts['onednn_prepack_s']:.3f} s in {parts['onednn_prepacks']} oneDNN weight prepacks")
    vocab = info["vocab_size"]
    embed_packs = {k: v for k, v in parts["onednn_prepack_s_by_shape"].items() if str(vocab) in k.split("x")}
    console.print(f"  prepacks of the (tied) embedding's shape: {embed_packs}; peak extra anon of the "
                  f"new path = {res['new']['peak_extra_anon_bytes'] / info['largest_tensor_bytes']:.2f}x the largest "
                  f"tensor; anon memory held after the sync, before malloc_trim: "
                  f"{res['new']['anon_held_after_bytes'] / 2**20:,.0f} MiB")
    console.print(f"[dim]load: {fmt(load.mean, '.1f')} (1-min load average during the run); "
                  f"torch threads {args.threads}[/]")

    new = res["new"]
    payload = {
        "seconds": new["seconds"], "floor_seconds": new["floor_seconds"],
        "ratio_to_floor": new["ratio_to_floor"], "peak_extra_bytes": new["peak_extra_bytes"],
        "peak_extra_model_multiple": new["peak_extra_model_multiple"],
        "peak_extra_anon_bytes": new["peak_extra_anon_bytes"],
        "peak_extra_largest_tensor_multiple": new["peak_extra_bytes"] / info["largest_tensor_bytes"],
        "old": {k: res["old"][k] for k in ("seconds", "floor_seconds", "ratio_to_floor", "peak_extra_bytes",
                                           "peak_extra_model_multiple", "peak_extra_anon_bytes")},
        "paths": res,
        "new_parts": parts,
        "model": info,
        "quick": args.quick, "reps": reps, "threads": args.threads,
        "startup_seconds": startup, "load_avg": load.mean,
        "correctness": {"syncs_checked": raw["checks"], "near_ties": raw["near_ties"],
                        "stale_differs": raw["stale_differs"], "max_logprob_diff": raw["max_logprob_diff"],
                        "prompts": len(PROMPTS),
                        "max_tokens": MAX_TOKENS},
    }
    if json_stdout:
        sys.stdout.flush()
        os.write(out_fd, (json.dumps(payload, default=float) + "\n").encode())
    else:
        write_json(args.json, payload, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
