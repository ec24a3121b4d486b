"""Weight sync between Ray actors (disaggregated placement): broadcast over a weight bus against the
object store, for one trainer and R rollout actors.

- object-store (the earlier path, ``rollout.weight_sync: object-store``): the trainer's
  ``named_weights()`` (float32 numpy copies of every weight) returned into Ray's object store;
  each rollout actor's ``load_weights`` of that dict.
- broadcast (the default): ``WeightBus.send(policy.iter_weights(), ...)`` on the trainer, each
  rollout actor ``policy.load_weights(bus.receive(...))``: buckets of ``--bucket-mb`` over gloo
  (what StageWorker.send_weights / receive_weights run).
- floor: one in-memory copy of the weights (``t.clone()`` of each tensor) in the trainer.

Per path: seconds per sync (median over interleaved repetitions; the driver waits for every
side), and peak extra memory of the trainer and of a rollout actor (VmRSS and RssAnon sampled
every 2 ms around the call, above the value at its start, after gc and malloc_trim). Before every
sync the trainer's weights are perturbed, and after it each rollout actor's weights must equal
the trainer's exactly (a checksum per tensor): a sync that skipped weights would fail.

Model: Qwen2.5-0.5B's shapes at random init (``_common.random_qwen2``), float32; ``--quick``:
hidden 256, 4 layers (~43M parameters). Actors hold 1 torch thread each.

Run: python benchmarks/actor_weight_sync.py [--quick] [--json [PATH]] [--reps R] [--replicas R] [--bucket-mb MB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import fmt, make_console, random_qwen2, write_json  # noqa: E402
from rich.console import Console  # noqa: E402

FULL = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936}
QUICK = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 1024, "vocab_size": 151936}
PATHS = ("broadcast", "object-store", "floor")


class Side:
    """A trainer (rank 0) or a rollout actor: an HFPolicy and, once joined, its weight bus."""

    def __init__(self, model_dir: str):
        from dapo_flow import threads
        from dapo_flow.models.hf import HFPolicy

        threads.configure(1)
        self.policy = HFPolicy(model_dir)
        self.bus = None
        self.manifest = self.policy.weight_manifest()

    def address(self):
        from dapo_flow.runtime.node import node_address

        return node_address()

    def join(self, addr: str, port: int, rank: int, world: int) -> bool:
        from dapo_flow.models.weight_bus import WeightBus

        self.bus = WeightBus(addr, port, rank, world)
        return True

    def perturb(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.policy.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)

    def checksums(self) -> list[float]:
        import torch

        with torch.no_grad():
            return [float(t.double().sum()) for _, t in self.policy.iter_weights()]

    def _measured(self, fn):
        from weight_sync import PeakRSS, settle

        settle()
        start = time.perf_counter()
        with PeakRSS() as peak:
            out = fn()
        return out, {"seconds": time.perf_counter() - start, "extra_rss": peak.extra_rss, "extra_anon": peak.extra_anon}

    def export(self):
        return self._measured(self.policy.named_weights)

    def import_(self, weights) -> dict:
        return self._measured(lambda: self.policy.load_weights(weights))[1]

    def send(self, bucket: int) -> dict:
        return self._measured(lambda: self.bus.send(self.policy.iter_weights(), self.manifest, bucket))[1]

    def receive(self, bucket: int) -> dict:
        return self._measured(lambda: self.policy.load_weights(self.bus.receive(self.manifest, bucket)))[1]

    def floor(self) -> dict:
        import torch

        def copy():
            with torch.no_grad():
                return [t.clone() for t in {id(p): p for p in self.policy.model.state_dict().values()}.values()]

        return self._measured(lambda: len(copy()))[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a ~43M model instead of ~0.5B")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the results as JSON (to PATH, or stdout)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    args = p.parse_args(argv)
    console = make_console() if args.json != "-" else Console(stderr=True, width=120)

    import ray

    from dapo_flow.models.tokenizer import build_char_tokenizer

    shape = QUICK if args.quick else FULL
    bucket = int(args.bucket_mb * 2**20)
    with tempfile.TemporaryDirectory(prefix="dapo-flow-actor-sync-") as tmp:
        info = random_qwen2(Path(tmp), shape, build_char_tokenizer(model_max_length=512))
        console.print(f"{info['num_parameters'] / 1e6:.1f}M parameters, {info['model_bytes'] / 2**20:,.0f} MiB "
                      f"float32; 1 trainer -> {args.replicas} rollout actor(s); buckets of {args.bucket_mb:g} MB")
        ray.init(address="local", num_cpus=1 + args.replicas, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
        try:
            actor = ray.remote(num_cpus=1)(Side)
            trainer = actor.remote(tmp)
            rollouts = [actor.remote(tmp) for _ in range(args.replicas)]
            addr, port = ray.get(trainer.address.remote())
            world = 1 + args.replicas
            ray.get([trainer.join.remote(addr, port, 0, world),
                     *(r.join.remote(addr, port, 1 + i, world) for i, r in enumerate(rollouts))])
            runs: dict[str, list[dict]] = {k: [] for k in PATHS}
            mismatches = 0
            for rep in range(args.reps + 1):  # the first round is a warm-up, not kept
                order = PATHS[rep % 3:] + PATHS[:rep % 3]
                for path in order:
                    ray.get(trainer.perturb.remote(rep * 10 + PATHS.index(path)))
                    start = time.perf_counter()
                    if path == "broadcast":
                        sent = trainer.send.remote(bucket)
                        got = ray.get([r.receive.remote(bucket) for r in rollouts])
                        sides = {"trainer": ray.get(sent), "rollout": got[0]}
                    elif path == "object-store":
                        ref, exported = trainer.export.options(num_returns=2).remote()
                        got = ray.get([r.import_.remote(ref) for r in rollouts])
                        sides = {"trainer": ray.get(exported), "rollout": got[0]}
                        del ref
                    else:
                        sides = {"trainer": ray.get(trainer.floor.remote())}
                    seconds = time.perf_counter() - start
                    if path != "floor":
                        want = ray.get(trainer.checksums.remote())
                        mismatches += sum(ray.get(r.checksums.remote()) != want for r in rollouts)
                    if rep:
                        runs[path].append({"seconds": seconds, **sides})
        finally:
            ray.shutdown()

    floor = statistics.median(r["seconds"] for r in runs["floor"])
    result = {"model": {k: info[k] for k in ("num_parameters", "model_bytes")}, "replicas": args.replicas,
              "bucket_bytes": bucket, "reps": args.reps, "mismatched_syncs": mismatches, "floor_seconds": floor}
    for path in ("broadcast", "object-store"):
        seconds = statistics.median(r["seconds"] for r in runs[path])
        result[path] = {
            "seconds": seconds, "ratio_to_floor": seconds / floor,
            "trainer_peak_extra_anon": max(r["trainer"]["extra_anon"] for r in runs[path]),
            "rollout_peak_extra_anon": max(r["rollout"]["extra_anon"] for r in runs[path]),
            "trainer_peak_extra_rss": max(r["trainer"]["extra_rss"] for r in runs[path]),
            "rollout_peak_extra_rss": max(r["rollout"]["extra_rss"] for r in runs[path]),
        }
    b, o = result["broadcast"], result["object-store"]
    result["seconds"], result["ratio_to_floor"] = b["seconds"], b["ratio_to_floor"]
    result["peak_extra_bytes"] = max(b["trainer_peak_extra_anon"], b["rollout_peak_extra_anon"])
    result["speedup_vs_object_store"] = o["seconds"] / b["seconds"]
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    for path, r in (("broadcast", b), ("object-store", o)):
        console.print(f"{path:13s} {fmt(r['seconds'])} s ({fmt(r['ratio_to_floor'], '.2f')}x floor); peak extra anon: "
                      f"trainer {mib(r['trainer_peak_extra_anon'])}, rollout {mib(r['rollout_peak_extra_anon'])}")
    console.print(f"floor         {fmt(floor)} s; broadcast is {result['speedup_vs_object_store']:.2f}x the object "
                  f"store's speed; syncs whose weights differed: {mismatches}")
    if args.json == "-":
        print(json.dumps(result, default=float))
    else:
        write_json(args.json, result, console)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
