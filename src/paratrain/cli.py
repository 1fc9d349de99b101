"""The ``paratrain`` command: run, validate, graph, schema.

Bad input never produces a traceback: every ConfigError (and any error a job's own
code raises while loading) prints one ``field.path: message`` line per problem and the
command exits 2. Failures during training exit 1 with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

# the rest is imported where used: `paratrain run` pauses the collector before (main)
from .worker import failed, usage

__all__ = ["main"]

EXIT_OK = 0


def _cmd_validate(args: argparse.Namespace) -> int:
    """Errors exit 2; settings the job sets but its run ignores are printed as
    ``PATH: warning: FIELD ignored: REASON`` lines (stderr) and keep exit 0."""
    from .config import ConfigError
    from .config.job import load_job
    from .dispatch import effective_settings
    from .executors import import_plugins, spec_for
    from .preflight import preflight

    worst = EXIT_OK
    for path in args.jobs:
        try:
            job = load_job(path)
            # plugins register coordinators and factories that the checks look at
            import_plugins(job.run.imports, base=Path(path).resolve().parent)
            warnings = [f"{path}: warning: {item}" for item in effective_settings(job).ignored]
            # every check `run` makes before training (paratrain.preflight)
            notes = preflight(job, job_dir=Path(path).resolve().parent, warn=False)
            warnings += [f"{path}: warning: {note}" for note in notes]
        except ConfigError as e:
            worst = usage(e, f"{path}: ")
        else:
            for line in warnings:
                print(line, file=sys.stderr)
            if not args.quiet:
                print(f"{path}: ok")
                try:  # how the job runs, as its executor tells (runtime, TP layout, ZeRO shards...)
                    for line in spec_for(job).describe(job):
                        print(f"{path}: {line}")
                except ConfigError as e:
                    worst = usage(e, f"{path}: ")
            if getattr(args, "explain", False):
                from .explain import explain, render

                try:
                    report = explain(job)
                except ConfigError as e:
                    worst = usage(e, f"{path}: ")
                else:
                    print(render({**report, "job": path}))
    return worst


def _cmd_graph(args: argparse.Namespace) -> int:
    """The job's model as a graph (paratrain.explain): nodes in execution order with
    parameters, effective strategy and worker; subgraphs; values crossing workers."""
    from .config import ConfigError
    from .explain import explain_file, render

    try:
        report = explain_file(args.job, edges=args.out is not None)
        if args.out is not None:  # the picture instead (paratrain.graph.draw)
            from .graph.draw import draw

            print(draw(report, args.out))
            return EXIT_OK
    except ConfigError as e:
        return usage(e, f"{args.job}: ")
    print(json.dumps(report, indent=2) if args.json else render(report))
    return EXIT_OK


def _cmd_schema(args: argparse.Namespace) -> int:
    from .config import compression_schema, job_schema, strategy_schema

    which = {"job": job_schema, "strategy": strategy_schema, "compression": compression_schema}
    print(json.dumps(which[args.what](), indent=2))
    return EXIT_OK


def _final_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"paratrain — {summary.get('strategy', 'run')}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, dict | list):
            continue
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        table.add_row(key, text)
    Console().print(table)


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .config.job import load_job

    try:
        job = load_job(args.job)
    except ConfigError as e:
        return usage(e, f"{args.job}: ")
    if getattr(args, "whole_process", False) and _trains_here(job):
        from .training.report import start_drawer

        start_drawer()  # report.png's matplotlib on the other core while torch loads here
    from .dispatch import execute

    if args.quiet and "progress_every" not in job.run.model_fields_set:  # -q: no progress either
        job = job.model_copy(update={"run": job.run.model_copy(update={"progress_every": "off"})})
    clash = [f for f, v in (("--resume", args.resume), ("--overwrite", args.overwrite),
                            ("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                            ("--rdzv-endpoint", args.rdzv_endpoint)) if v]
    if args.join_group is not None and clash:  # a joining group takes the running job as it is
        return usage(ConfigError([("--join-group", f"cannot be used with {', '.join(clash)}")]), "error: ")
    # Multi-node launch options travel to comm.launch through the environment, the
    # same way torchrun passes its own settings; checked first, so an error names the flag.
    from .comm.rendezvous import check_nodes

    try:
        check_nodes(args.nnodes, args.node_rank, args.rdzv_endpoint)
    except ConfigError as e:
        return usage(e, "error: ")
    # Workers import the job's plugins (run.imports) relative to the job file's folder.
    os.environ.setdefault("PARATRAIN_JOB_DIR", str(Path(args.job).resolve().parent))
    if args.join_group is not None:
        return _join(job, args)
    for var, value in (("PARATRAIN_NNODES", args.nnodes), ("PARATRAIN_NODE_RANK", args.node_rank),
                       ("PARATRAIN_RDZV_ENDPOINT", args.rdzv_endpoint)):
        if value is not None:
            os.environ[var] = str(value)
    from .training.allocator import keep_freed_memory

    keep_freed_memory()  # this process trains (Local) and exits: no page refaults per step
    try:
        summary = execute(job, resume=args.resume, overwrite=args.overwrite,
                          job_dir=Path(args.job).resolve().parent)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - one clear line, not a traceback
        return failed(e, f"{args.job}: ")
    if not args.quiet:
        _final_table(summary)
        print(f"run folder: {summary.get('run_dir', '')}")
    return EXIT_OK


def _join(job: Any, args: argparse.Namespace) -> int:
    """``--join-group G``: replica group G of the running fault-tolerant job, until it ends."""
    from .config import ConfigError
    from .executors import join_group

    try:
        record = join_group(job, args.join_group)
    except ConfigError as e:
        return usage(e, f"{args.job}: ")
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - one clear line, not a traceback
        return failed(e, f"{args.job}: ")
    if not args.quiet:
        print(json.dumps(record) if record is not None else "the run had ended")
    return EXIT_OK


def _trains_here(job: Any) -> bool:
    """A Local run: this process trains and draws report.png."""
    from .config import ConfigError
    from .executors import executor_name

    try:
        return executor_name(job) == "Local"
    except ConfigError:
        return False


def _cmd_export(args: argparse.Namespace) -> int:
    """Write a finished run's model (one state_dict under the model's own names) to --out."""
    from .config import ConfigError
    from .training.export import export_hf, export_model

    hf = args.format == "hf"  # a from_pretrained folder (paratrain.training.export.export_hf)
    out = args.out or f"{Path(args.run).resolve().name}{'-hf' if hf else '.safetensors'}"
    try:
        if args.out is None and Path(out).exists():
            raise ConfigError([("--out", f"{out} exists; name the file to write with --out")])
        if hf:
            path = export_hf(args.run, out, client=args.client)
        else:
            path = export_model(args.run, out, client=args.client)
    except ConfigError as e:
        return usage(e, f"{args.run}: ")
    if not args.quiet:
        print(path)
    return EXIT_OK


def _version() -> str:
    """The installed package's version (its metadata), or "unknown" when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("paratrain")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"paratrain {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job file (TOML, JSON or YAML)")
    r.add_argument("job")
    once = r.add_mutually_exclusive_group()
    once.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    once.add_argument("--overwrite", action="store_true",
                      help="replace the run folder's previous run (otherwise a fresh run refuses)")
    r.add_argument("--nnodes", type=int, help="number of machines (multi-node launch)")
    r.add_argument("--node-rank", type=int, help="this machine's rank among --nnodes")
    r.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (rank-0 machine)")
    r.add_argument("--join-group", type=int, metavar="G",
                   help="[fault_tolerance]: run replica group G against the running job (its "
                        "Lighthouse: the job's `lighthouse`, or the one in the run folder)")
    r.add_argument("-q", "--quiet", action="store_true",
                   help="no summary table, and no progress unless the job sets run.progress_every")
    r.set_defaults(fn=_cmd_run)

    v = sub.add_parser("validate", help="check job files; exit 2 listing every problem")
    v.add_argument("jobs", nargs="+")
    v.add_argument("-q", "--quiet", action="store_true")
    v.add_argument("--explain", action="store_true",
                   help="also print each job's model as a graph (as `paratrain graph`)")
    v.set_defaults(fn=_cmd_validate)

    g = sub.add_parser("graph", help="print the job's model as a graph: nodes in execution order, "
                                     "parameters, strategies, workers, values crossing workers")
    g.add_argument("job")
    g.add_argument("--json", action="store_true", help="the report as JSON")
    g.add_argument("--out", help="draw it to this file instead (.svg, .png or .pdf): nodes "
                                 "coloured by worker, values crossing workers on the arrows")
    g.set_defaults(fn=_cmd_graph)

    e = sub.add_parser("export", help="write a finished run's model as one state_dict under the "
                                       "model's own names (.safetensors or .pt)")
    e.add_argument("run", help="the run folder (runs/<name>)")
    e.add_argument("--out", help="model.safetensors or model.pt (default: ./<run name>.safetensors)")
    e.add_argument("--client", type=int, help="Federated: this client's model with its personal parts")
    e.add_argument("--format", choices=["state_dict", "hf"], default="state_dict",
                   help="hf: a Hugging Face transformers model as the folder from_pretrained "
                        "reads (config.json, model.safetensors; --out names the folder)")
    e.add_argument("-q", "--quiet", action="store_true")
    e.set_defaults(fn=_cmd_export)

    s = sub.add_parser("schema", help="print the JSON Schema of the job file")
    s.add_argument("what", nargs="?", choices=["job", "strategy", "compression"], default="job")
    s.set_defaults(fn=_cmd_schema)
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line ``argv`` (None: ``sys.argv``, the ``paratrain`` command itself, whose
    process exits when the command returns: the garbage collector stays off a run's start-up
    and exit (:mod:`paratrain.training.gcfreeze`) and a Local run's report.png is drawn by a
    drawer process). Called with ``argv`` (tests, scripts) it leaves the process as it was."""
    args = build_parser().parse_args(argv)
    args.whole_process = argv is None
    if argv is None:
        from .training.gcfreeze import own_process

        own_process(pause=args.command == "run")
    try:
        code: int = args.fn(args)
    finally:
        if argv is None:
            from .training.gcfreeze import freeze_for_exit, resume_collections

            resume_collections()  # a run that failed before it trained
            freeze_for_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())
