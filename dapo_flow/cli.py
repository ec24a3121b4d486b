"""`dapo-flow`: parse args -> call dapo_flow's library functions. Nothing else lives here.

Any DapoFlowError is printed (no traceback) and exits 2, as are an OSError (a path that cannot
be read or written, with its name) and an MLflow error (a tracking store it cannot use). torch,
ray and mlflow are only imported by the commands that need them (plus whatever importing the
operators costs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from rich.console import Console
from rich.markup import escape

from dapo_flow.errors import DapoFlowError
from dapo_flow.runtime.executors import EXECUTORS

EXAMPLES = {
    "validate": "dapo-flow validate graphs/dapo.yaml",
    "explain": "dapo-flow explain graphs/dapo.yaml --cpus 8 --gpus 2",
    "graph": "dapo-flow graph graphs/dapo.yaml -o dapo.png     (or .svg, .mmd)",
    "ops": "dapo-flow ops",
    "run": "dapo-flow run graphs/dapo.yaml --executor local --steps 5",
    "eval": "dapo-flow eval graphs/dapo.yaml --n 16 --temperature 1.0   (latest checkpoint; or --checkpoint base|PATH)",
    "export": "dapo-flow export dapo-flow-runs/checkpoints/dapo-68afb26d49/RUN_ID -o dapo-final   (newest step)",
    "models": "dapo-flow models build tiny-adder --force",
    "ui": "dapo-flow ui --port 5000",
    "serve-reward": "dapo-flow serve-reward my_rewards.py:compute_score --port 8000 --concurrency 8",
    "serve": "dapo-flow serve graphs/harness.yaml --port 8000   (or --checkpoint an exported model folder)",
    "sweep": "dapo-flow sweep graphs/ablations/dapo-ladder.yaml --executor local --seeds 0,1",
    "compare": "dapo-flow compare dapo-ladder -o ladder.png   (experiment name or parent run id)",
    "diff": "dapo-flow diff graphs/grpo.yaml graphs/dapo.yaml   (files or MLflow run ids)",
}
EDIT_EXAMPLE = ("edits (repeatable, applied in the order given):\n"
                "  dapo-flow run graphs/dapo.yaml --set train.lr=5e-4 --drop overlong "
                "--set adv.reward_column=score")


def main(argv: list[str] | None = None) -> int:
    err = Console(stderr=True, soft_wrap=True)
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] not in (["-h"], ["--help"], []):  # the command list needs no plugin (nor torch)
            from dapo_flow.graph.registry import load_plugins

            load_plugins()  # first: plugins may add executors, which the parser lists as choices
        args = _parser().parse_args(argv)
        return args.func(args) or 0
    except DapoFlowError as exc:
        return _error(err, str(exc))
    except OSError as exc:  # a path that cannot be read or written (the checks name the common ones)
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return _error(err, f"{exc.strerror or exc}{': ' + where if where else ''}\n    fix: check that path "
                      "(a file you can read, a folder that exists and that you can write)")
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "mlflow":
            raise
        from dapo_flow.tracking import STORE_URI_FIX

        return _error(err, f"MLflow: {str(exc).strip().splitlines()[0]}\n    fix: {STORE_URI_FIX}")


def _error(err: Console, text: str) -> int:
    """Print ``text`` as the command's error (no traceback); the exit status for bad input."""
    err.print("[bold red]error:[/] ", end="")
    err.print(text, markup=False, highlight=False)
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo-flow",
        description="DAPO/GRPO RL steps as typed operator DAGs: validate, explain, draw, run.",
        epilog="examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=f"example:\n  {EXAMPLES[name]}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    p = command("validate", "Check a graph (types, wiring, columns, placement); print ok or every problem.", _validate)
    p.add_argument("graph", help="graph YAML file")
    _edit_flags(p)
    p.add_argument("--effective", action="store_true", help="also print the effective (edited) graph")
    _cluster_flags(p)
    p = command("explain", "Print the compiled, placed plan without starting Ray.", _explain)
    p.add_argument("graph", help="graph YAML file")
    _edit_flags(p)
    _cluster_flags(p)
    p = command("graph", "Draw the graph's DAG to a .png, .svg or .mmd (mermaid) file.", _graph)
    p.add_argument("graph", help="graph YAML file")
    p.add_argument("-o", "--out", required=True, help="output file: .png, .svg or .mmd")
    _edit_flags(p)
    command("ops", "List every operator: columns in/out with Arrow types, cardinality, params.", _ops)
    p = command("run", "Compile the graph and train (on Ray, or in-process with --executor local).", _run)
    p.add_argument("graph", help="graph YAML file")
    p.add_argument("--executor", choices=list(EXECUTORS), default="ray", help="default: ray")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_ID", type=_run_id,
                   help="continue the newest unfinished run of this graph, or RUN_ID")
    p.add_argument("--steps", type=_positive_int, help="override run.steps (>= 1)")
    _edit_flags(p)
    p = command("eval", "Evaluate a checkpoint (or the base model): avg@n, pass@k, response length; "
                "logged to MLflow. With --sweep: every variant x seed of a sweep.", _eval)
    p.add_argument("graph", help="graph YAML file (with the --set edits it was trained with), or with "
                   "--sweep a patch file")
    p.add_argument("--sweep", action="store_true",
                   help="GRAPH is a sweep patch file: evaluate each variant x seed's newest checkpoint "
                        "and compare them (mean ± std over seeds)")
    p.add_argument("--seeds", help="with --sweep: the seeds it was run with, e.g. 0,1,2")
    p.add_argument("--only", help="with --sweep: comma-separated variant names (default: all)")
    p.add_argument("--checkpoint", default="latest", metavar="latest|base|PATH",
                   help="latest: the graph's newest checkpoint (default); base: the untrained models; "
                        "or a step_* checkpoint folder")
    p.add_argument("--n", type=_int_in(1, 1024), help="samples per prompt, 1-1024 (default run.val_n)")
    p.add_argument("--temperature", type=_temperature, help="sampling temperature, 0-10 (default "
                   "run.val_temperature)")
    p.add_argument("--source", help="prompts: builtin:addition, or a .parquet / .jsonl file (default data.val)")
    p.add_argument("--split", help="split of a built-in task (default data.val's)")
    p.add_argument("--size", type=_positive_int, help="use at most this many prompts")
    p.add_argument("--seed", type=_seed, help="sampling seed (default the graph's; does not change which "
                   "checkpoint is found)")
    p.add_argument("--batch-size", type=int, default=None, metavar="PROMPTS",
                   help="prompts per generation batch: the set streams through generation and grading "
                        "this many at a time, a parquet source read batch by batch (default 256)")
    p.add_argument("--save", metavar="FILE.parquet",
                   help="write every graded sample (prompt, response, ground truth, score, acc) to this "
                        "parquet file")
    p.add_argument("--executor", choices=list(EXECUTORS), default="local", help="default: local")
    p.add_argument("--address", help="Ray cluster address (with --executor ray)")
    _edit_flags(p)
    p = command("export", "Write a checkpoint's trained model (sharded or not) as a Hugging Face directory.",
                _export)
    p.add_argument("checkpoint", help="a step_* checkpoint folder, or a run's or graph's folder (its newest)")
    p.add_argument("-o", "--out", required=True, help="new (or empty) output folder")
    p.add_argument("--model", help="which trained model (default: the checkpoint's only one)")
    p.add_argument("--adapter", action="store_true",
                   help="a model trained with train.lora: write its adapters in peft's format "
                        "(PeftModel.from_pretrained) instead of the weights merged into its base")
    p = command("sweep", "Run every variant of a patch file (x seeds) as MLflow child runs of one parent.",
                _sweep)
    p.add_argument("patch", help="patch YAML file, e.g. graphs/ablations/dapo-ladder.yaml")
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (each applied as --set seed=S)")
    p.add_argument("--steps", type=_positive_int,
                   help="run.steps for every variant (applied as --set run.steps=N)")
    p.add_argument("--executor", choices=list(EXECUTORS), default="ray", help="default: ray")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    p.add_argument("--only", help="comma-separated variant names to run (default: all)")
    p.add_argument("--parallel", type=_positive_int, default=1, metavar="N",
                   help="run N variants at once in separate processes (default 1: one after another)")
    p.add_argument("--dry-run", action="store_true", help="validate every variant, print the edits, train nothing")
    p = command("compare", "Table (mean ± std over seeds) and val-acc / reward plot of a sweep's variants.",
                _compare)
    p.add_argument("target", metavar="EXPERIMENT_OR_PARENT_RUN",
                   help="a sweep's experiment name (its latest sweep) or parent run id")
    p.add_argument("-o", "--out", default="compare.png", help="plot file (default compare.png)")
    p.add_argument("--baseline", metavar="VARIANT", default=None,
                   help="variant the others' final val acc is compared with, difference and 95%% "
                        "Welch CI over seeds (default: the sweep's first variant)")
    p = command("diff", "Show what differs between two effective graphs (files or MLflow run ids).", _diff)
    p.add_argument("a", help="graph YAML file or MLflow run id")
    p.add_argument("b", help="graph YAML file or MLflow run id")
    p = command("models", "Manage built-in models.", None)
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    b = msub.add_parser("build", help="Build (train) a built-in model into the cache.",
                        description="Build (train) a built-in model into the cache.",
                        epilog=f"example:\n  {EXAMPLES['models']}",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", help="built-in model name, e.g. tiny-adder")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    b.set_defaults(func=_models_build)
    p = command("serve", "Serve the graph's model as an OpenAI-compatible endpoint (try a harness before "
                "training it); prints the address and the token.", _serve)
    p.add_argument("graph", help="graph YAML file")
    p.add_argument("--model", help="which of the graph's models (default: its first generating node's)")
    p.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face model folder (`dapo-flow export`) "
                   "instead of the model's path")
    p.add_argument("--port", type=_int_in(0, 65535), default=0, help="default 0: a free port")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1, this machine only; others need the token)")
    p.add_argument("--replicas", type=_int_in(1, 64), default=1,
                   help="copies of the model, one address in front (episodes stick to one; default 1)")
    _edit_flags(p)
    p = command("ui", "Open the MLflow UI on the runs' tracking store, at the newest experiment's charts.", _ui)
    p.add_argument("--port", type=_port, default=5000, help="default 5000")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1, this machine only; MLflow's UI has no login)")
    p = command("serve-reward", "Serve a reward function over HTTP (POST /score, GET /health) for a "
                "score node's `reward: http://HOST:PORT`.", _serve_reward)
    p.add_argument("reward", metavar="REF", help="file.py:fn, module:fn, builtin:NAME, or a verl reward "
                   "file's compute_score (file.py:compute_score)")
    p.add_argument("--port", type=_port, default=8000, help="default 8000")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1, this machine only; the server has no login)")
    p.add_argument("--concurrency", type=_int_in(1, 1024), default=4, metavar="K",
                   help="threads the reward function runs in, 1-1024 (default 4)")
    return parser


def _int_in(low: int, high: int | None = None, what: str = "a whole number"):
    """argparse type: an integer in [low, high] (argparse prints the message and exits 2)."""
    bounds = f">= {low}" if high is None else f"{low}-{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what} {bounds}, got {value}")
        return value

    return parse


_positive_int = _int_in(1)


def _temperature(text: str) -> float:
    """argparse type: a sampling temperature in [0, 10] (a generate node's bounds; nan refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number 0-10, got {text!r}") from None
    if not 0.0 <= value <= 10.0:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"must be a number 0-10, got {text}")
    return value


def _run_id(text: str) -> str:
    """argparse type: a run id (an empty one, e.g. an unset $RUN_ID, would start a new run)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the run id is empty: give one, or --resume alone for the newest run")
    return text


_port = _int_in(1, 65535, "a port number")


def _amount(text: str) -> float:
    """argparse type: a finite number >= 0 (CPUs, GPUs, GiB)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _positive_amount(text: str) -> float:
    """argparse type: a finite number > 0 (a cluster's CPUs: actors need some)."""
    value = _amount(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster", "place (and check memory) for this cluster instead of this machine")
    g.add_argument("--cpus", type=_positive_amount, help="CPUs in all (default: this machine)")
    g.add_argument("--gpus", type=_amount, help="GPUs in all (default: this machine)")
    g.add_argument("--nodes", type=_positive_int, default=1, help="machines (default 1)")
    g.add_argument("--gpu-mem-gib", type=_amount, metavar="GIB",
                   help="memory of one GPU, e.g. 80: each actor's estimated peak must fit its share "
                        "(default: this machine's GPU; unknown: not checked)")


def _cluster(args: argparse.Namespace):
    """The cluster the cluster flags describe; None (this machine) without them."""
    from dapo_flow.graph.plan import Cluster

    if args.cpus is None and args.gpus is None and args.nodes == 1 and args.gpu_mem_gib is None:
        return None
    local = Cluster.local()
    gpus = args.gpus if args.gpus is not None else local.gpus
    mem = args.gpu_mem_gib if args.gpu_mem_gib is not None else (local.gpu_mem_gib if gpus else None)
    return Cluster(cpus=args.cpus if args.cpus is not None else local.cpus, gpus=gpus, nodes=args.nodes,
                   gpu_mem_gib=mem)


def _seed(text: str) -> int:
    from dapo_flow.graph.spec import MAX_SEED

    return _int_in(0, MAX_SEED, "a seed")(text)


class _EditAction(argparse.Action):
    """--set/--drop/--swap/--insert append (flag, text) to one list, keeping their order."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), (self.const, values)])


def _edit_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("edits", "repeatable; applied in the order given")
    g.add_argument("--set", dest="edits", action=_EditAction, const="set", default=[],
                   metavar="PATH=VALUE", help="NODE.PARAM=VALUE or SECTION.KEY=VALUE (VALUE is YAML)")
    g.add_argument("--drop", dest="edits", action=_EditAction, const="drop", metavar="NODE",
                   help="remove NODE; its consumers read NODE's inputs")
    g.add_argument("--swap", dest="edits", action=_EditAction, const="swap", metavar="NODE=OP",
                   help="replace NODE's op, keeping id and wiring")
    g.add_argument("--insert", dest="edits", action=_EditAction, const="insert",
                   metavar="NEW:OP:after=NODE", help="add a node between NODE and its consumers")
    p.epilog = (p.epilog or "") + "\n" + EDIT_EXAMPLE


def _edited(args: argparse.Namespace):
    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.registry import load_plugins

    load_plugins()
    return edit_file(args.graph, parse_cli_edits(getattr(args, "edits", None) or []))


def _compile(args: argparse.Namespace, cluster=None):
    return _edited(args).compile(cluster)


def _line(text: str, *, stderr: bool = False, markup: bool = True) -> None:
    """Print a one-line status message as one line: rich would fold it at the terminal's width
    (80 columns when piped), so a long path split "6 nodes" across lines for grep or a script."""
    Console(stderr=stderr, soft_wrap=True, highlight=False).print(text, markup=markup)


def _validate(args: argparse.Namespace) -> int:
    edited = _edited(args)
    placed = edited.compile(_cluster(args))
    p = placed.plan
    edits = f" with {len(edited.edits)} edit(s)" if edited.edits else ""
    _line(f"[green]ok[/]: {escape(args.graph)}{edits}: graph '{p.spec.name}', {len(p.nodes)} nodes, "
          f"{len(placed.stages)} stages")
    if args.effective:
        sys.stdout.write(edited.yaml())
    return 0


def _explain(args: argparse.Namespace) -> int:
    from dapo_flow.graph.explain import explain

    sys.stdout.write(explain(_compile(args, _cluster(args))))
    return 0


def _graph(args: argparse.Namespace) -> int:
    from dapo_flow.graph.drawing import draw

    out = draw(_compile(args), args.out)
    _line(f"wrote {out}", markup=False)
    return 0


def _joined(args: argparse.Namespace):
    """The Ray cluster a run joins (`--address`, else $RAY_ADDRESS, with --executor ray): the
    graph is placed on what it has free. None: this machine, which a Ray of its own then serves."""
    address = args.address or os.environ.get("RAY_ADDRESS")
    if args.executor != "ray" or address in (None, "", "local"):
        return None
    from dapo_flow.runtime.executors import joined_cluster

    return joined_cluster(address)


def _run(args: argparse.Namespace) -> int:
    edited = _edited(args)
    placed = edited.compile(_joined(args))
    from dapo_flow.tracking import require_writable

    require_writable(placed.plan.spec.tracking.uri)  # before minutes of model loading
    from dapo_flow.graph.drawing import plan_artifacts
    from dapo_flow.runtime import execute

    artifacts = plan_artifacts(placed)
    params = {}  # with edits: log them as params and the effective graph beside the file
    if edited.edits:
        params = edited.params()
        artifacts["graph/effective.yaml"] = edited.yaml()
    execute(placed, executor=args.executor, address=args.address, resume=args.resume, steps=args.steps,
            extra_params=params, artifacts=artifacts)
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dapo_flow.runtime.export import export

    step, model, at = export(Path(args.checkpoint).expanduser(), Path(args.out), args.model, args.adapter)
    what = ("LoRA adapters, peft's format: PeftModel.from_pretrained(base, path)" if args.adapter
            else "Hugging Face format; point a graph's path: at it")
    _line(f"wrote {args.out}: model '{model}' at step {at} of {step} ({what})", markup=False)
    return 0


def _eval(args: argparse.Namespace) -> int:
    for flag in ("n", "size", "batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise DapoFlowError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.temperature is not None and args.temperature < 0:
        raise DapoFlowError(f"--temperature must be >= 0, got {args.temperature}")
    options = dict(which=args.checkpoint, n=args.n, temperature=args.temperature, source=args.source,
                   split=args.split, size=args.size, seed=args.seed, executor=args.executor, address=args.address,
                   **({"batch_size": args.batch_size} if args.batch_size else {}))
    console = Console(highlight=False)
    if args.sweep:
        from dapo_flow.experiments import sweep
        from dapo_flow.graph.registry import load_plugins
        from dapo_flow.experiments.evaluate import evaluate_sweep

        if args.save:
            raise DapoFlowError("--save writes one eval's samples; with --sweep each run's samples are "
                                "logged to its MLflow run: drop --save")
        if args.edits or args.checkpoint != "latest":
            raise DapoFlowError("--sweep evaluates each run's newest checkpoint of the patch's own graphs: "
                                "drop --set/--drop/--swap/--insert and --checkpoint")
        load_plugins()
        patch = sweep.load_patch(args.graph)
        jobs = sweep.plan_jobs(patch, only=args.only, seeds=args.seeds)
        evaluate_sweep(patch, sweep.validate_jobs(patch, jobs), console=console, **options)
        return 0
    if args.seeds or args.only:
        raise DapoFlowError("--seeds and --only go with --sweep (GRAPH a patch file)")
    placed = _edited(args).compile(_joined(args))
    from dapo_flow.experiments.evaluate import evaluate

    evaluate(placed, console=console, save=args.save, **options)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from dapo_flow.experiments import sweep
    from dapo_flow.graph.registry import load_plugins

    load_plugins()
    patch = sweep.load_patch(args.patch)
    jobs = sweep.plan_jobs(patch, only=args.only, seeds=args.seeds, steps=args.steps)
    console = Console(highlight=False)
    if args.dry_run:
        ready = sweep.validate_jobs(patch, jobs)
        console.print(sweep.dry_run_report(patch, ready), crop=False)
        console.print(f"[green]ok[/]: every variant compiles ({len(ready)} run(s)); nothing trained (--dry-run)")
        return 0
    result = sweep.run_sweep(patch, jobs, executor=args.executor, address=args.address,
                             parallel=args.parallel, console=console)
    return 1 if result.failed else 0


def _compare(args: argparse.Namespace) -> int:
    from dapo_flow.experiments import compare

    compare.compare(args.target, out=args.out, console=Console(highlight=False), baseline=args.baseline)
    return 0


def _diff(args: argparse.Namespace) -> int:
    from dapo_flow.experiments import graphdiff

    graphdiff.print_diff(args.a, args.b, Console(highlight=False))
    return 0


def _models_build(args: argparse.Namespace) -> int:
    try:
        from dapo_flow.models import build_builtin
    except ImportError as exc:
        raise DapoFlowError(f"the model builder is not available: {exc}") from None
    name = args.name.removeprefix("builtin:")  # as a graph names it, or bare
    path = build_builtin(name, force=args.force)
    _line(f"built {name} at {path}", markup=False)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import time

    from dapo_flow.runtime.serve import serve

    endpoint = serve(_compile(args).plan, model=args.model, checkpoint=args.checkpoint, host=args.host,
                     port=args.port, replicas=args.replicas)
    name = endpoint.model_name
    behind = f"  ({args.replicas} replicas behind it)" if args.replicas > 1 else ""
    _line(f"OpenAI-compatible endpoint on {endpoint.base_url}  model '{name}'  token {endpoint.token}{behind}\n"
          f"  openai.OpenAI(base_url=\"{endpoint.base_url}\", api_key=\"{endpoint.token}\")  (Ctrl-C stops it)",
          markup=False)
    try:
        while True:  # short waits: a Ctrl-C the kernel hands to a server thread still stops it here
            time.sleep(0.5)
    finally:
        endpoint.close()
    return 0


def _ui(args: argparse.Namespace) -> int:
    _require_free_port(args.port, args.host)  # before seconds of importing MLflow
    try:
        from dapo_flow.tracking import default_tracking_uri, newest_experiment, open_store
    except ImportError as exc:
        raise DapoFlowError(f"tracking is not available: {exc}") from None
    warning = ui_host_warning(args.host)
    if warning:
        _line(f"warning: {warning}", stderr=True, markup=False)
    uri = default_tracking_uri()
    open_store(uri)  # create or migrate it under the store's lock, not racing a starting run
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
           "--host", args.host, "--port", str(args.port), "--workers", "1"]
    url = ui_url(args.host, args.port, newest_experiment(uri))
    _line(f"MLflow UI on {url}  (store: {uri})", stderr=True, markup=False)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform == "darwin":
        import threading
        import webbrowser

        threading.Timer(3.0, webbrowser.open, (url,)).start()  # once the server is likely up
    return _run_owned(cmd, env)


def _serve_reward(args: argparse.Namespace) -> int:
    from dapo_flow.reward_server.server import host_warning, serve

    _require_free_port(args.port, args.host)
    warning = host_warning(args.host)
    if warning:
        _line(f"warning: {warning}", stderr=True, markup=False)
    serve(args.reward, host=args.host, port=args.port, concurrency=args.concurrency,
          announce=lambda text: _line(text, stderr=True, markup=False))
    return 0


def ui_url(host: str, port: int, newest: tuple[str, str] | None) -> str:
    """Where the UI should open: the training runs of the experiment run last, in MLflow's chart
    view (its own landing page is its GenAI overview, empty for training runs, and the runs page
    opens on a table: a person opening the dashboard wants the curves first)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    base = f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}"
    return f"{base}/#/experiments/{newest[0]}/runs?compareRunsMode=CHART" if newest else base


def ui_host_warning(host: str) -> str | None:
    """A warning when the UI would serve beyond this machine, or None for a loopback address."""
    import ipaddress

    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    return (f"serving on {host}: anyone who can reach it reads every run (params, metrics, sample texts, "
            f"artifacts) and can change or delete them; MLflow's UI has no login. Leave --host at "
            f"127.0.0.1 and reach it over ssh -L instead, where you can")


def _require_free_port(port: int, host: str = "127.0.0.1") -> None:
    """Bind the port the UI will serve on, so a busy one is an error now, not a server that
    starts, fails to listen and leaves the user at a dead URL."""
    import errno
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind((host, port))
        except OSError as exc:  # socket.gaierror too: a host name that does not resolve
            busy = exc.errno == errno.EADDRINUSE
            why = " (another `dapo-flow ui` or server is listening there)" if busy else ""
            if busy:
                fix = f"pick a free port, e.g. --port {port + 1 if port < 65535 else 5000}, or stop what uses {port}"
            elif exc.errno == errno.EACCES:  # a port below 1024 without the privilege
                fix = "pick a port above 1023, e.g. --port 5000"
            else:
                fix = "--host takes an address of this machine: 127.0.0.1 (the default) or 0.0.0.0 (every interface)"
            raise DapoFlowError(f"cannot serve on {host}:{port}: {exc.strerror or exc}{why}\n    fix: {fix}") from None


def _run_owned(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` as a child in its own process group and wait for it. SIGTERM, SIGINT and
    SIGHUP sent to us go to the whole group (mlflow and its uvicorn server), so stopping
    `dapo-flow ui` stops the server; a group member still alive at the end is stopped too."""
    import signal

    proc: subprocess.Popen | None = None
    early: list[int] = []  # a signal before the child exists is sent once it does

    def forward(signum, _frame):
        if proc is None:
            early.append(signum)
        else:
            _signal_group(proc.pid, signum)

    caught = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, forward) for sig in caught}
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        for signum in early:
            _signal_group(proc.pid, signum)
        return proc.wait()
    finally:
        if proc is not None:
            _stop_group(proc.pid)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to a process group; False when nothing in it is left."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False


def _stop_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM what is left of the group, SIGKILL it after ``grace_s``."""
    import signal
    import time

    if not _signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _signal_group(pgid, 0):
            return
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)


def _ops(args: argparse.Namespace) -> int:
    from dapo_flow.graph.catalog import print_catalog
    from dapo_flow.graph.registry import CUSTOM_OP, load_plugins

    print_catalog(load_plugins(), CUSTOM_OP, Console(highlight=False, soft_wrap=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
