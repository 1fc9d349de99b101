"""The picture of a :func:`paratrain.explain.explain` report (``paratrain graph JOB --out FILE``):
the nodes top to bottom in layers of the data flow, coloured by worker, the edges on which a
value crosses workers thick and labelled. Drawn with matplotlib (Agg); the file's suffix picks
the format; SVG text stays text.

The data flow (:func:`node_edges`): an edge ``from -> to`` when a value ``from`` computes
reaches ``to`` through nodes that are no listed module. Such a node joining the values of two
or more nodes (a residual ``add``) is a node of its own, named by its fx name (collapsed, each
residual block would feed every later one). Each edge keeps the fx names it passes, so a value
crossing workers finds its edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.fx as fx

from ..config import ConfigError
from .render import shape_text, value_text
from .trace import module_of

INPUT, OUTPUT = "(input)", "(output)"


def _owner(n: fx.Node, paths: set[str]) -> str | None:
    """The listed module ``n`` belongs to (None: an intermediate node)."""
    if n.op == "placeholder":
        return INPUT
    if n.op == "output":
        return OUTPUT
    # a get_attr (a tensor of a module): that module's node
    path = str(n.target).rpartition(".")[0] if n.op == "get_attr" else module_of(n)
    return path if path in paths else None


def node_edges(gm: fx.GraphModule, paths: list[str]) -> list[dict[str, Any]]:
    """``[{"from", "to", "through"}]`` between ``paths`` (and the pseudo nodes), in first-seen
    order; ``through``: the fx node names the values pass on the way, the computing node's
    included (see the module docstring)."""
    listed = set(paths)
    # reach[name]: for each listed node whose values flow into fx node `name` unlisted,
    # the fx names they passed (the listed node's own output node first)
    reach: dict[str, dict[str, set[str]]] = {}
    edges: dict[tuple[str, str], set[str]] = {}
    for n in gm.graph.nodes:
        owner = _owner(n, listed)
        incoming: dict[str, set[str]] = {}
        for a in n.all_input_nodes:
            for src, via in reach.get(a.name, {}).items():
                incoming.setdefault(src, set()).update(via)
        # a function of one node's values passes them on, adding itself; the model's inputs
        # do not count (masks and positions made from them would make every op a node)
        if owner is None and len(set(incoming) - {INPUT}) < 2:
            reach[n.name] = {src: via | {n.name} for src, via in incoming.items()}
            continue
        owner = owner or n.name  # a function joining values of several nodes: a node itself
        for src, via in incoming.items():
            if src != owner:
                edges.setdefault((src, owner), set()).update(via)
        reach[n.name] = {owner: {n.name}}
    return [{"from": s, "to": t, "through": sorted(via)} for (s, t), via in edges.items()]


_PSEUDO = "#dddddd"  # the (input) and (output) boxes, and nodes no worker runs
_CROSS = "#c0392b"


def _names(report: Mapping[str, Any], edges: list[dict[str, Any]]) -> list[str]:
    """Every node in execution order: (input), the report's nodes with each joining function
    (:func:`node_edges`) right after the last node feeding it, (output)."""
    names = [INPUT, *(r["node"] for r in report["nodes"]), OUTPUT]
    for e in edges:  # in fx order: a joining node's feeders come before it
        if e["to"] not in names:
            feeders = [names.index(f["from"]) for f in edges if f["to"] == e["to"] and f["from"] in names]
            names.insert(max(feeders, default=0) + 1, e["to"])
    return names


def _layers(names: list[str], edges: list[dict[str, Any]]) -> dict[str, int]:
    """Each node's layer: one below the deepest node feeding it from earlier in execution
    order (an edge back, as a module called twice makes, does not push it down)."""
    order = {n: i for i, n in enumerate(names)}
    layer = dict.fromkeys(names, 0)
    for n in names:
        for e in edges:
            if e["to"] == n and order[e["from"]] < order[n]:
                layer[n] = max(layer[n], layer[e["from"]] + 1)
    return layer


def _positions(names: list[str], edges: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """(x, y) per node: y the layer (downwards), x spread in the layer in the order of the
    mean x of the nodes feeding it (fewer crossing arrows)."""
    layer = _layers(names, edges)
    feeds: dict[str, list[str]] = {n: [] for n in names}
    for e in edges:
        feeds[e["to"]].append(e["from"])
    pos: dict[str, tuple[float, float]] = {}
    for depth in range(max(layer.values(), default=0) + 1):
        row = [n for n in names if layer[n] == depth]
        xs = {n: sum(pos[f][0] for f in feeds[n] if f in pos) / max(1, sum(f in pos for f in feeds[n]))
              for n in row}
        row.sort(key=lambda n: xs[n])
        for i, n in enumerate(row):
            pos[n] = (i - (len(row) - 1) / 2, -float(depth))
    return pos


def _crossings(report: Mapping[str, Any], where: Mapping[str, str]) -> tuple[dict[tuple[str, str], list[str]], list[str]]:
    """The labels of the edges a value crosses workers on, and the values found on no edge
    (a parameter read by another worker, say: listed under the picture instead)."""
    labels: dict[tuple[str, str], list[str]] = {}
    unplaced: list[str] = []
    # the sending end: a module's own worker only (a joining function's is a guess that may be
    # the receiving side's); the receiving end: any node's worker, guessed ones included
    own = {r["node"]: r["worker"] for r in report["nodes"] if "worker" in r}
    for t in report.get("transfers", []):
        text = f"{value_text(t, report['model'])} {shape_text(t.get('shape'))}".strip()
        to = set(t.get("to_replicas") or [t["to"]])
        hits = [(e["from"], e["to"]) for e in report.get("edges", [])
                if t["node"] in e["through"] and where.get(e["to"], t["to"]) in to
                and own.get(e["from"], t["from"]) in (t.get("from_replicas") or [t["from"]])]
        for key in hits:
            labels.setdefault(key, []).append(text)
        if not hits:
            unplaced.append(f"{t['from']} -> {t['to']}: {text}")
    return labels, unplaced


def _workers(report: Mapping[str, Any], names: list[str], edges: list[dict[str, Any]]) -> dict[str, str]:
    """The worker of each node: the report's; (output)'s the loss worker's; a joining function
    runs where every node it feeds runs (its consumers' worker when they agree)."""
    where = {r["node"]: r["worker"] for r in report["nodes"] if "worker" in r}
    if report.get("loss_worker"):
        where[OUTPUT] = report["loss_worker"]
    for n in reversed(names):  # consumers first
        if n not in where and n != INPUT:
            fed = {where.get(e["to"]) for e in edges if e["from"] == n}
            if len(fed) == 1 and None not in fed:
                where[n] = fed.pop()  # type: ignore[assignment]
    return where


def _colours(report: Mapping[str, Any]) -> dict[str, Any]:
    """A colour per worker (the tab20 palette, cycling past 20 workers)."""
    from matplotlib import colormaps

    palette = colormaps["tab20"]
    workers = [w["worker"] for w in report.get("workers", [])]
    return {w: palette((2 * i) % 20 if len(workers) <= 10 else i % 20) for i, w in enumerate(workers)}


def draw(report: Mapping[str, Any], out: str | Path) -> Path:
    """Draw ``report`` (with its ``edges``: ``explain(job, edges=True)``) to ``out``; a
    ConfigError naming --out for a folder that does not exist or a suffix matplotlib cannot write."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    out = Path(out)
    kinds = Figure().canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in kinds:
        raise ConfigError([("--out", f"{out}: the file name must end in .svg, .png or .pdf "
                                     f"(or one of {', '.join(sorted(kinds))})")])
    if not out.parent.is_dir():
        raise ConfigError([("--out", f"{out.parent} is not a folder")])
    edges = report.get("edges", [])
    names = _names(report, edges)
    edges = [e for e in edges if e["from"] in names and e["to"] in names]
    where = _workers(report, names, edges)
    pos = _positions(names, edges)
    colours = _colours(report)
    labels, unplaced = _crossings({**report, "edges": edges}, where)
    width = max(len([n for n in names if pos[n][1] == y]) for y in {p[1] for p in pos.values()})
    depth = 1 - min(p[1] for p in pos.values())
    with rc_context({"svg.fonttype": "none"}):
        fig = Figure(figsize=(max(7.0, 2.8 * width + 3), max(4.0, 0.9 * depth + 1.5)))
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.set_xlim(-width / 2 - 0.5, width / 2 + 0.5)
        ax.set_ylim(-depth + 0.5, 0.5)
        _draw_edges(ax, edges, pos, labels)
        modules = {r["node"]: r["module"] for r in report["nodes"]}
        for n in names:  # a module: its box in its worker's colour; a joining function: a dot
            box = {"boxstyle": "round,pad=0.4", "fc": colours.get(where.get(n, ""), _PSEUDO),
                   "ec": "#333333"} if n in modules else {"boxstyle": "round,pad=0.3",
                                                          "fc": "white" if n not in (INPUT, OUTPUT)
                                                          else _PSEUDO, "ec": "#777777"}
            ax.text(*pos[n], f"{n}\n{modules[n]}" if n in modules else n, ha="center", va="center",
                    fontsize=8 if n in modules else 7, zorder=3, bbox=box)
        _legend(ax, report, colours, bool(labels))
        if unplaced:
            fig.text(0.01, 0.005, "values crossing workers (not on an arrow):\n" + "\n".join(unplaced),
                     fontsize=7, va="bottom")
        ax.set_title(f"{report['model']}: {report['parameters']:,} parameters, strategy "
                     f"{report['strategy']}", fontsize=10)
        fig.savefig(out, bbox_inches="tight")
    return out


def _draw_edges(ax: Any, edges: list[dict[str, Any]], pos: Mapping[str, tuple[float, float]],
                labels: Mapping[tuple[str, str], list[str]]) -> None:
    """Arrows between the nodes (curved when they skip a layer); a crossing one thick and
    labelled on it (staggered along parallel arrows)."""
    for k, e in enumerate(edges):
        (x0, y0), (x1, y1) = pos[e["from"]], pos[e["to"]]
        crossing = labels.get((e["from"], e["to"]))
        bend = 0.0 if abs(y1 - y0) <= 1 or x0 != x1 else 0.35
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=1,
                    arrowprops={"arrowstyle": "-|>", "shrinkA": 14, "shrinkB": 14,
                                "color": _CROSS if crossing else "#555555",
                                "lw": 2.2 if crossing else 0.9,
                                "connectionstyle": f"arc3,rad={bend}"})
        if crossing:  # a point of arc3's Bezier curve, in display units
            (a0, b0), (a1, b1) = ax.transData.transform([(x0, y0), (x1, y1)])
            c = ((a0 + a1) / 2 + bend * (b1 - b0), (b0 + b1) / 2 - bend * (a1 - a0))
            t = 0.5 if bend else 0.4 + 0.2 * ((k * 0.618) % 1)
            at = tuple((1 - t) ** 2 * p0 + 2 * (1 - t) * t * pc + t ** 2 * p1
                       for p0, pc, p1 in zip((a0, b0), c, (a1, b1), strict=True))
            side = "center" if not bend else "right" if at[0] < (a0 + a1) / 2 else "left"
            ax.text(*ax.transData.inverted().transform(at), "\n".join(crossing),
                    fontsize=7, color=_CROSS, ha=side, va="center", zorder=4,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": _CROSS, "lw": 0.6})


def _legend(ax: Any, report: Mapping[str, Any], colours: Mapping[str, Any],
            crossing: bool) -> None:
    """Every worker with its rank and parameters (or the one strategy), and the crossing arrow."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(fc=colours[w["worker"]], ec="#333333",
                                label=f"{w['worker']} (rank {w['rank']}, {w['parameters']:,} params)")
                          for w in report.get("workers", [])]
    if not handles:
        handles.append(Patch(fc=_PSEUDO, ec="#333333", label=f"every node: {report['strategy']}"))
    if crossing:
        handles.append(Line2D([], [], color=_CROSS, lw=2.2, label="value crossing workers (shape)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
