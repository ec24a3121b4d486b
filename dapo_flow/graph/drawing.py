"""Pictures of a plan's DAG: mermaid text (``.mmd``) or an image (``.png`` / ``.svg``).

Nodes are labelled "id\\nop", edges with the columns the upstream node added (what flows
new on that edge), abbreviated when long. Images use networkx + matplotlib (Agg backend,
no display needed), layered top to bottom in topological order.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from dapo_flow.core import columns as C
from dapo_flow.errors import DapoFlowError
from dapo_flow.graph.plan import PlacedPlan, Plan
from dapo_flow.graph.spec import PROMPTS_SOURCE

FORMATS = (".mmd", ".png", ".svg")


def to_networkx(plan: Plan) -> nx.DiGraph:
    """The plan as a DiGraph: node attrs ``op``, ``cardinality``, ``layer``; edge attr
    ``columns`` (names the source node added)."""
    graph = nx.DiGraph()
    graph.add_node(PROMPTS_SOURCE, op="source", cardinality="source", layer=0)
    added = {PROMPTS_SOURCE: list(C.prompt_schema().names)}
    for node in plan.nodes:
        layer = 1 + max((graph.nodes[i]["layer"] for i in node.inputs if i in graph), default=0)
        graph.add_node(node.id, op=node.op, cardinality=node.cardinality, layer=layer)
        seen = set(node.in_schema.names) if node.cardinality != "sink" else set()
        added[node.id] = [name for name in node.out_schema.names if name not in seen]
        for i in node.inputs:
            graph.add_edge(i, node.id, columns=added.get(i, []))
    return graph


def edge_label(columns: list[str], limit: int = 2) -> str:
    """'a, b' or 'a, b +3' when there are more than ``limit``."""
    shown = ", ".join(columns[:limit])
    return shown + (f" +{len(columns) - limit}" if len(columns) > limit else "")


def mermaid(plan: Plan | PlacedPlan) -> str:
    """Mermaid flowchart text; nodes grouped by stage when given a PlacedPlan."""
    placed = plan if isinstance(plan, PlacedPlan) else None
    graph = to_networkx(placed.plan if placed else plan)
    lines = ["flowchart TD", f"  {_mid(PROMPTS_SOURCE)}([{PROMPTS_SOURCE}])"]

    def box(nid: str) -> str:
        op = graph.nodes[nid]["op"]
        return f'  {_mid(nid)}["{nid}<br/><i>{op}</i>"]'

    if placed is not None:
        for stage in placed.stages:
            if stage.nodes:
                lines.append(f'  subgraph s{_mid(stage.name)[1:]}["{stage.name}"]')
                lines += ["  " + box(nid) for nid in stage.nodes]
                lines.append("  end")
    else:
        lines += [box(nid) for nid in graph.nodes if nid != PROMPTS_SOURCE]
    for u, v, data in graph.edges(data=True):
        label = edge_label(data["columns"])
        arrow = f'-->|"{label}"|' if label else "-->"
        lines.append(f"  {_mid(u)} {arrow} {_mid(v)}")
    return "\n".join(lines) + "\n"


def _mid(name: str) -> str:
    """A mermaid-safe identifier."""
    return "n_" + "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


def draw(plan: Plan | PlacedPlan, out: str | Path) -> Path:
    """Write the DAG to ``out``; the suffix picks the format (.mmd, .png, .svg)."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise DapoFlowError(f"cannot draw to '{out}': use one of {', '.join(FORMATS)}")
    if suffix == ".mmd":
        out.write_text(mermaid(plan), encoding="utf-8")
        return out
    _draw_image(plan, out)
    return out


def _draw_image(plan: Plan | PlacedPlan, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    placed = plan if isinstance(plan, PlacedPlan) else None
    p = placed.plan if placed else plan
    graph = to_networkx(p)
    pos = nx.multipartite_layout(graph, subset_key="layer", align="horizontal")
    pos = {n: (x, -y) for n, (x, y) in pos.items()}  # layer 0 on top
    stage_of = dict(placed.node_stage) if placed else {}
    stages = sorted(set(stage_of.values()))
    palette = ["#d9e8fb", "#fde2c8", "#d5f0d5", "#f3d5f0", "#fff3b0", "#e0e0e0"]
    colors = [
        "#ffffff" if n == PROMPTS_SOURCE else
        palette[stages.index(stage_of[n]) % len(palette)] if n in stage_of else palette[0]
        for n in graph.nodes
    ]
    layers = max(nx.get_node_attributes(graph, "layer").values()) + 1
    width = max(sum(1 for _, d in graph.nodes(data=True) if d["layer"] == k) for k in range(layers))
    fig, ax = plt.subplots(figsize=(max(6.0, 3.0 * width), max(4.0, 1.2 * layers)))
    nx.draw_networkx_edges(graph, pos, ax=ax, arrows=True, arrowsize=14, edge_color="#555555",
                           min_source_margin=18, min_target_margin=18)
    for (n, data), color in zip(graph.nodes(data=True), colors):  # text boxes as nodes
        ax.text(*pos[n], f"{n}\n{data['op']}", ha="center", va="center", fontsize=9, zorder=3,
                bbox={"boxstyle": "round,pad=0.5", "fc": color, "ec": "#333333"})
    edge_labels = {(u, v): edge_label(d["columns"]) for u, v, d in graph.edges(data=True)}
    nx.draw_networkx_edge_labels(graph, pos, edge_labels=edge_labels, ax=ax, font_size=7,
                                 rotate=False, font_color="#204a87",
                                 bbox={"boxstyle": "round", "fc": "white", "ec": "none", "alpha": 0.9})
    if placed is not None:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(facecolor=palette[i % len(palette)], edgecolor="#333333", label=s)
                           for i, s in enumerate(stages)], loc="lower right", fontsize=8)
    ax.set_title(f"{p.spec.name} ({Path(p.file).name})")
    ax.axis("off")
    ax.margins(x=0.3, y=0.06)
    fig.tight_layout()
    fig.savefig(out, format=out.suffix.lower()[1:])
    plt.close(fig)


def plan_artifacts(placed: PlacedPlan) -> dict[str, str | bytes]:
    """What a run logs about its plan (``execute(artifacts=...)``): the text `explain` prints
    as graph/plan.txt, and the DAG as graph/dag.png (left out if drawing fails: a picture is
    nice to have, never a reason to fail a run)."""
    import tempfile

    from dapo_flow.graph.explain import explain

    out: dict[str, str | bytes] = {"graph/plan.txt": explain(placed)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "dag.png"
            draw(placed, path)
            out["graph/dag.png"] = path.read_bytes()
    except Exception:  # noqa: BLE001 - see the docstring
        pass
    return out
