"""Text of a :func:`paratrain.explain.explain` report (``paratrain graph JOB``):
the nodes in execution order, the subgraphs, the values crossing workers and the
parameters per worker, as aligned tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _n(x: int) -> str:
    return f"{x:,}"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(header), *(line(r) for r in rows)]


def shape_text(shape: Any) -> str:
    """``[32, 128]`` (several outputs: each, comma-separated; none: empty)."""
    if shape is None:
        return ""
    if shape and isinstance(shape[0], list):
        return ", ".join(shape_text(s) for s in shape)
    return "[" + ", ".join(str(d) for d in shape) + "]"


def value_text(t: Mapping[str, Any], model: str) -> str:
    """A value crossing workers as the tables name it: the module or node computing it."""
    if t.get("attr"):
        return f"parameter {t['attr']}"
    if t.get("op") == "call_module":
        return str(t["in_module"])
    return f"{t['node']} (in {t.get('in_module') or model}.forward)"


def render(report: Mapping[str, Any]) -> str:
    """The report as text (what ``paratrain graph JOB`` prints)."""
    mp = report["strategy"] == "ModelParallel"
    head = f"{report['model']}: {_n(report['parameters'])} parameters, strategy {report['strategy']}"
    if mp:
        head += f" ({report.get('protocol')}, {len(report.get('workers', []))} workers)"
    if report.get("job"):
        head = f"{report['job']}: {head}"
    out = [head, "", "nodes, in execution order:"]
    if report.get("runtime"):  # Federated: the local path or Flower's deployment runtime
        out[1:1] = [f"runs on {report['runtime']}"]
    out += _nodes(report["nodes"], mp)
    if report["subgraphs"]:
        out += ["", "subgraphs (modules with children):", *_subgraphs(report["subgraphs"], mp)]
    if mp:
        out += _placement(report)
    if report.get("tensor_parallel"):
        out += ["", f"tensor parallel (size {report.get('tensor_parallel_size')}), modules sharded:"]
        out += _table(["module", "sharding"], [[t["module"], t["sharding"]] for t in report["tensor_parallel"]],
                      set())
    if report.get("mesh"):  # parallelisms composed on one mesh: its shape, rank formula, groups
        out += _mesh(report["mesh"])
    if report.get("shard"):  # DataParallel ZeRO: what each replica holds 1/N of
        out += _shard(report["shard"])
    if report.get("shapes_unavailable"):
        out.append(f"(shapes left out: ShapeProp failed on one training batch: {report['shapes_unavailable']})")
    return "\n".join(out)


def _nodes(nodes: list[dict[str, Any]], mp: bool) -> list[str]:
    """The nodes table (with each node's worker and part under ModelParallel)."""
    header = ["#", "node", "module", "params", "strategy"] + (["worker", "part"] if mp else [])
    rows = []
    for r in nodes:
        strat = r["strategy"] + (f" ({r['strategy_from']})" if r["strategy_from"] != "strategy" else "")
        cells = [str(r["index"]), r["node"] + (f" (x{r['calls']})" if "calls" in r else ""),
                 r["module"], _n(r["parameters"]), strat]
        if mp:
            where = f"{r['worker']} (rank {r['rank']})" if "worker" in r else ""
            if len(r.get("replicas", ())) > 1:
                where += " + " + ", ".join(r["replicas"][1:])
            cells += [where, str(r.get("part", ""))]
        rows.append(cells)
    return _table(header, rows, {0, 3})


def _subgraphs(groups: list[dict[str, Any]], mp: bool) -> list[str]:
    """The subgraphs table: own or inherited strategy (and workers under ModelParallel)."""
    header = ["subgraph", "module", "params", "strategy"] + (["workers"] if mp else [])
    rows = []
    for g in groups:
        strat = (f"{g['own_strategy']} (own" + (f", shard = {g['shard']})" if "shard" in g else ")")
                 if "own_strategy" in g else
                 g["strategy"] + (f" (from {g['strategy_from']})" if g["strategy_from"] != "strategy"
                                  else " (inherited)"))
        cells = [g["subgraph"], g["module"], _n(g["parameters"]), strat]
        if mp:
            cells.append(", ".join(g.get("workers", [])))
        rows.append(cells)
    return _table(header, rows, {2})


def _placement(report: Mapping[str, Any]) -> list[str]:
    """ModelParallel: the values crossing workers and the parameters per worker."""
    batch = report.get("batch_rows")
    when = f" (shapes for one batch of {batch} rows" if batch and "shapes_unavailable" not in report else ""
    mb = report.get("micro_batch_size")
    if when and mb and mb < batch:
        when += f", sent as micro-batches of {mb}"
    when += ")" if when else ""
    out = ["", f"values crossing workers, sent forward with their gradients back{when}:"]
    if report["transfers"]:
        rows = []
        for t in report["transfers"]:
            ends = [" + ".join(t.get(f"{e}_replicas") or [t[e]]) for e in ("from", "to")]
            rows.append([*ends, value_text(t, report["model"]),
                         shape_text(t.get("shape")) + (f" {t['dtype']}" if t.get("dtype") else ""),
                         _n(t["bytes"]) if t.get("bytes") is not None else ""])
        out += _table(["from", "to", "value (the node computing it)", "shape", "bytes"], rows, {4})
    else:
        out.append("  none (every node runs on one worker)")
    out += ["", "parameters per worker:"]
    out += _table(["worker", "rank", "params", "parts"],
                  [[w["worker"], str(w["rank"]), _n(w["parameters"]),
                    (", ".join(map(str, w["parts"])) or "none")
                    + (f" (replica {w['replica']} of {w['replicas']}"
                       + (f", a copy of {w['replica_of']}'s)" if w["replica"] else ")")
                       if "replica" in w else "")]
                   for w in report["workers"]], {1, 2})
    out.append(f"  the loss is computed on {report['loss_worker']}")
    if report.get("parameters_not_run"):
        out.append(f"  {_n(report['parameters_not_run'])} parameters sit in modules the forward never runs")
    return out


def _mesh(m: Mapping[str, Any]) -> list[str]:
    """The mesh's shape, rank formula and groups (and ZeRO over it)."""
    out = ["", "mesh " + " x ".join(f"{d} {n}" for d, n in zip(m["dims"], m["sizes"], strict=True))
           + f": {m['layout']}"]
    out += [f"  {d} groups: {' '.join(str(g) for g in gs)}" for d, gs in m["groups"].items()]
    if m.get("zero"):
        out.append(f"  {m['zero']} (units below: tp rank 0's shard)")
    if m.get("note"):
        out.append(f"  {m['note']}")
    return out


def _shard(z: Mapping[str, Any]) -> list[str]:
    """ZeRO's units: what each replica holds 1/N of."""
    out = ["", f"ZeRO-{z['zero_stage']} (shard = {z['level']}) over {z['replicas']} replicas: "
           f"about {_n(z['adam_fp32_bytes_per_rank'])} bytes a replica for fp32 Adam; units:"]
    out += _table(["unit", "params", "per replica", "parameters"],
                  [[u["unit"], _n(u["elements"]), _n(u["elements_per_rank"]),
                    ", ".join(u["parameters"][:4]) + (" ..." if len(u["parameters"]) > 4 else "")]
                   for u in z["units"]], {1, 2})
    if z["whole"]:
        out.append(f"  kept whole on every replica: {', '.join(z['whole'])}")
    return out
