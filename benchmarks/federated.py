"""Federated benchmark: client updates per second and peak memory, 100 and 1,000 clients.

Workload: digits, MLP 64-64-10, IID split (``partition_iid``, seed 0), every client
selected every round, 1 local epoch, B = 10, SGD lr 0.1, FedAvg weighted by example
count, 2 worker processes / 2 CPUs.

* ``paratrain``: the job as ``paratrain run`` runs it (``paratrain.dispatch.execute``: the
  launcher's 2 worker processes over gloo, each set up as every launched worker is): the
  real round loop (broadcast, local training, updates over point-to-point, validation and
  aggregation, centralised evaluation on the test split, metrics line, checkpoint at the
  default cadence: every round).
* ``naive`` peer: the textbook PyTorch simulation on 2 processes (gloo) that keeps one
  ``nn.Module`` + optimizer alive per client, trains them in turn, averages with an
  all-reduce and, like paratrain's server, evaluates the averaged model on the test split
  on rank 0 after every round (same loss and accuracy sums, batches of 1,024); no
  checkpoints, no update checks, no metrics file.
* ``flwr`` peer, only if ``flwr`` is importable (optional ``bench`` extra,
  ``pip install -e '.[bench]'``): Flower's Simulation Runtime
  (``flwr.simulation.run_simulation``, Message API: ``ClientApp`` / ``ServerApp`` with
  ``flwr.serverapp.strategy.FedAvg``, ``fraction_train=1``, ``fraction_evaluate=0``,
  centralised evaluation on the test split through ``evaluate_fn`` as paratrain does),
  Ray backend with ``num_cpus=2`` and ``client_resources={"num_cpus": 1}`` -> 2 actors (1 at
  ``--smoke``: each actor process imports torch and Flower).
  Each ClientApp call builds the MLP, loads the global arrays, trains one epoch and
  returns its arrays with ``num-examples`` (the Flower tutorial idiom); the digits
  tensors and partition are cached per actor process, so no data loading is timed.
  Nothing is downloaded (no flower-datasets). Flower's per-update cost grows with
  the number of clients: in flwr 1.42 the in-memory LinkState's ``get_message_ins``
  scans every stored message for each node it serves (O(K) per node, O(K^2) a round).

Throughput (measured): client updates / round wall time, the median over rounds,
excluding the first (warm-up) round for every system. paratrain's round is everything
it does per round, its checkpoint write and metrics log included: the time between the
``time_s`` stamps of consecutive rounds in metrics.jsonl (round r's stamp is taken after
its evaluation; the interval up to round r+1's covers r's metrics line and server
checkpoint, then r+1's broadcast, training, upload, aggregation and evaluation). Flower:
``configure_train`` -> end of ``evaluate_fn``; naive: broadcast -> evaluated averaged model
(neither checkpoints).

Peak memory: every system runs in a fresh child process; the parent samples that
child's whole process tree (the child, the worker ranks / Ray actors, and for Flower
Ray's gcs_server, raylet and agents) from /proc every 50 ms (1 s at ``--smoke``: a sample of
Ray's tree costs about 10 ms of CPU). ``peak_tree_pss_mb`` = the
peak of the summed PSS (proportional set size: shared pages split between the
processes mapping them, so a sum does not double-count) -- the headline figure;
``peak_proc_rss_mb`` = the largest RSS of any one process in the tree. Prints one JSON
object with the ratios paratrain/peer (throughput ratio > 1 and memory ratio < 1 favour
paratrain). ``--quick`` (``make bench``): 100 and 1,000 clients (Flower at 100 only), 11 rounds
(1 warm-up + 10 timed: a round is a fraction of a second, its median over 5 was noisy), 3 repeats;
``--smoke``: 10 clients, 2 rounds, every arm that can run, 1 Ray actor, memory sampled every
1 s (seconds; Flower's Ray start adds some). ``--repeat N`` runs every arm N times, interleaved, and reports medians and the median
of the paired ratios (a shared machine's load changes between arms); ``--checkpoint-every C``
adds a paratrain arm at ``run.checkpoint_every = C``; ``--compare-src DIR`` adds a paratrain
arm importing paratrain from another checkout's ``src`` (a paired before/after).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ != "__main__":  # a measured child (it imports benchmarks.federated): the parent only
    import torch  # starts the children and samples their memory, and imports no torch itself

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance  # noqa: E402

LR, BATCH, HIDDEN = 0.1, 10, [64]


def _job(out: str, k: int, rounds: int, checkpoint_every: int | str | None = None) -> dict[str, Any]:
    """The benchmark's job file, as a dict (digits, MLP, IID, every client every round);
    ``checkpoint_every``: ``run.checkpoint_every`` (None: the default, every round)."""
    from paratrain.config.job import load_job

    run: dict[str, Any] = {"name": f"bench{k}", "seed": 0, "output_dir": str(out), "num_workers": 2}
    if checkpoint_every is not None:
        run["checkpoint_every"] = checkpoint_every
    doc: dict[str, Any] = {
        "run": run,
        "model": {"name": "mlp", "hidden": HIDDEN},
        "train": {"optimizer": {"name": "sgd", "lr": LR}},
        "data": {"partition": {"method": "iid"}},
        "strategy": {"type": "Federated", "num_clients": k, "rounds": rounds,
                     "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}},
        "federated": {"local_epochs": 1, "batch_size": BATCH},
    }
    return load_job(doc).to_json_dict()


def _steady(values: list[float]) -> float:
    """Median over rounds, the first (warm-up) round left out when there are others."""
    return statistics.median(values[1:] if len(values) > 1 else values)


# ---------------------------------------------------------------- paratrain / naive

def bare_evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The global model's test loss and accuracy, what paratrain's server computes after every
    round (classification ``eval_batch`` sums over batches of 1,024: digits' test split is one)."""
    from torch import nn

    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(y), 1024):
            logits = model(x[a : a + 1024])
            loss_sum += float(nn.functional.cross_entropy(logits, y[a : a + 1024], reduction="sum"))
            correct += int((logits.argmax(dim=1) == y[a : a + 1024]).sum())
    model.train()
    return {"loss": loss_sum / max(len(y), 1), "accuracy": correct / max(len(y), 1)}


def naive_rank(ctx: Any, k: int, rounds: int) -> dict[str, Any]:
    """One live model + optimizer per hosted client; FedAvg through all_reduce; rank 0 then
    evaluates the global model on the test split, as paratrain's server does each round."""
    import torch.distributed as dist
    from torch import nn

    from paratrain.config.job import DataSpec, ModelSpec
    from paratrain.data import load_data
    from paratrain.data.partition import partition_iid
    from paratrain.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    bundle = load_data(DataSpec(), seed=0)
    x, y = bundle.train.tensors
    xt, yt = bundle.test.tensors
    parts = partition_iid(len(y), k, seed=0)
    spec = ModelSpec.model_validate({"name": "mlp", "hidden": HIDDEN})
    glob = build_model(spec, input_shape=(64,), num_classes=10)
    mine = [c for c in range(k) if c % ctx.world_size == ctx.rank]
    models = {c: build_model(spec, input_shape=(64,), num_classes=10) for c in mine}
    opts = {c: torch.optim.SGD(models[c].parameters(), lr=LR) for c in mine}
    times: list[float] = []
    accuracy: list[float] = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for p in glob.parameters():
            dist.broadcast(p.data, src=0)
        acc = [torch.zeros_like(p) for p in glob.parameters()]
        total = torch.zeros(1)
        for c in mine:
            m = models[c]
            m.load_state_dict(glob.state_dict())
            idx = torch.from_numpy(parts[c])
            perm = idx[torch.randperm(len(idx))]
            for i in range(0, len(perm), BATCH):
                b = perm[i : i + BATCH]
                opts[c].zero_grad()
                nn.functional.cross_entropy(m(x[b]), y[b]).backward()
                opts[c].step()
            for a, p in zip(acc, m.parameters(), strict=True):
                a.add_(p.detach(), alpha=float(len(idx)))
            total += len(idx)
        for a in acc:
            dist.all_reduce(a)
        dist.all_reduce(total)
        with torch.no_grad():
            for p, a in zip(glob.parameters(), acc, strict=True):
                p.copy_(a / total)
        if ctx.rank == 0:  # the server's per-round evaluation (the other rank waits, as in paratrain)
            accuracy.append(bare_evaluate(glob, xt, yt)["accuracy"])
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"round_times": times, "accuracy": accuracy,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child_paratrain(k: int, rounds: int, checkpoint_every: int | str | None = None,
                     **_: Any) -> dict[str, Any]:
    """The job as ``paratrain run`` runs it (:func:`paratrain.dispatch.execute`: the launcher's
    2 worker processes, set up as every launched worker is)."""
    from paratrain.config.job import load_job
    from paratrain.dispatch import execute
    from paratrain.training import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        summary = execute(load_job(_job(tmp, k, rounds, checkpoint_every)))
        recs = [r for r in read_metrics(summary["run_dir"]) if "round" in r]
    # Round r's period runs from round r-1's stamp to round r's, so it holds one metrics
    # line and one checkpoint write; round 1's period starts at the process start and
    # stands for the warm-up round (_steady leaves it out).
    stamps = [0.0] + [float(r["time_s"]) for r in recs]
    return {"updates_per_round": [r["clients_ok"] for r in recs],
            "round_times": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "round_times_excluding_log_and_checkpoint": [r["round_time_s"] for r in recs],
            "test_accuracy": recs[-1].get("test_accuracy"),
            "worker_ru_maxrss_mb": max(w["peak_rss_mb"] for w in summary["workers"])}


def _child_naive(k: int, rounds: int, **_: Any) -> dict[str, Any]:
    from paratrain.comm.testing import run_distributed

    res = run_distributed(naive_rank, 2, k, rounds, timeout_s=900)
    return {"updates_per_round": [k] * rounds, "round_times": res[0]["round_times"],
            "test_accuracy": res[0]["accuracy"][-1],
            "worker_ru_maxrss_mb": round(max(r["peak_rss_mb"] for r in res), 1)}


# ---------------------------------------------------------------- Flower

_FLWR_CACHE: dict[int, Any] = {}  # per process (Ray actor): k -> (x, y, parts)
_FLWR_T0: dict[int, float] = {}  # driver: round -> start time
_FLWR_LOG: dict[str, list[float]] = {"round_times": [], "accuracy": []}


def _flwr_data(k: int) -> Any:
    if k not in _FLWR_CACHE:
        from paratrain.config.job import DataSpec
        from paratrain.data import load_data
        from paratrain.data.partition import partition_iid

        bundle = load_data(DataSpec(), seed=0)
        x, y = bundle.train.tensors
        _FLWR_CACHE[k] = (x, y, partition_iid(len(y), k, seed=0), bundle.test)
    return _FLWR_CACHE[k]


def _flwr_model() -> torch.nn.Module:
    from paratrain.config.job import ModelSpec
    from paratrain.models import build_model

    return build_model(ModelSpec.model_validate({"name": "mlp", "hidden": HIDDEN}),
                       input_shape=(64,), num_classes=10)


def flwr_train(msg: Any, context: Any) -> Any:
    """ClientApp ``train``: one local epoch on this node's IID partition."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from torch import nn

    torch.set_num_threads(1)
    k = int(context.node_config["num-partitions"])
    x, y, parts, _ = _flwr_data(k)
    idx = torch.from_numpy(parts[int(context.node_config["partition-id"])])
    model = _flwr_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    perm = idx[torch.randperm(len(idx))]
    for i in range(0, len(perm), BATCH):
        b = perm[i : i + BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[b]), y[b]).backward()
        opt.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": len(idx)})})
    return Message(content=content, reply_to=msg)


def _child_flwr(k: int, rounds: int, actors: int = 2, **_: Any) -> dict[str, Any]:
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class TimedFedAvg(FedAvg):  # type: ignore[misc]
        def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
            _FLWR_T0[server_round] = time.perf_counter()
            return super().configure_train(server_round, arrays, config, grid)

    def evaluate_fn(server_round: int, arrays: Any) -> Any:
        model = _flwr_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        ev = bare_evaluate(model, *_flwr_data(k)[3].tensors)
        if server_round >= 1:
            _FLWR_LOG["round_times"].append(time.perf_counter() - _FLWR_T0[server_round])
            _FLWR_LOG["accuracy"].append(ev["accuracy"])
        return MetricRecord({"accuracy": ev["accuracy"], "loss": ev["loss"]})

    client_app = ClientApp()
    client_app.train()(flwr_train)
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                               min_train_nodes=k, min_available_nodes=k)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(_flwr_model().state_dict()),
                       num_rounds=rounds, evaluate_fn=evaluate_fn)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=k,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": actors, "num_gpus": 0,
                                                 "include_dashboard": False}})
    if len(_FLWR_LOG["round_times"]) != rounds:
        raise RuntimeError(f"Flower finished {len(_FLWR_LOG['round_times'])}/{rounds} rounds")
    return {"updates_per_round": [k] * rounds, "round_times": _FLWR_LOG["round_times"],
            "test_accuracy": _FLWR_LOG["accuracy"][-1]}


# ---------------------------------------------------------------- memory sampling

def _proc_tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _mem_kb(pid: int) -> tuple[int, int, str]:
    """(PSS kB, RSS kB, command name) of one process; zeros if it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
    except OSError:
        return 0, 0, ""
    return pss, rss, name


def _run_child(system: str, k: int, rounds: int, src: str | None = None, sample_s: float = 0.05,
               **opts: Any) -> dict[str, Any]:
    """Run one system in a fresh process tree, sampling its memory every ``sample_s``. ``src``:
    import paratrain from that source folder (another checkout's ``src``) instead of this
    one's; ``opts``: the system's options (paratrain: ``checkpoint_every``)."""
    with tempfile.TemporaryDirectory() as tmp:
        res_path, log_path = Path(tmp) / "result.json", Path(tmp) / "child.log"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(src or ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0", FLWR_TELEMETRY_ENABLED="0")
        code = ("import sys; from benchmarks import federated as f; "
                f"f.child_main({system!r}, {k}, {rounds}, sys.argv[1], **{json.dumps(opts)})")
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", code, str(res_path)], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            peak_pss = peak_rss = 0
            names: set[str] = set()
            t0 = time.perf_counter()
            while proc.poll() is None:
                pss_sum = 0
                for pid in _proc_tree(proc.pid):
                    pss, rss, name = _mem_kb(pid)
                    pss_sum += pss
                    peak_rss = max(peak_rss, rss)
                    if name:
                        names.add(name)
                peak_pss = max(peak_pss, pss_sum)
                if time.perf_counter() - t0 > 1800:
                    os.killpg(proc.pid, 9)
                time.sleep(sample_s)
        if proc.returncode != 0 or not res_path.exists():
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{system} child exited {proc.returncode}:\n{tail}")
        res: dict[str, Any] = json.loads(res_path.read_text())
    ups = [u / t for u, t in zip(res["updates_per_round"], res["round_times"], strict=True)]
    out = {"client_updates_per_s": round(_steady(ups), 1),
           "timed_rounds": max(len(ups) - 1, 1),
           "per_round_updates_per_s": [round(u, 1) for u in ups],
           "peak_tree_pss_mb": round(peak_pss / 1024, 1),
           "peak_proc_rss_mb": round(peak_rss / 1024, 1),
           "processes": sorted(names)}
    for key in ("test_accuracy", "worker_ru_maxrss_mb"):
        if res.get(key) is not None:
            out[key] = round(res[key], 4)
    return out


def child_main(system: str, k: int, rounds: int, out_path: str, **opts: Any) -> None:
    """Entry point of one measured child process; writes its result as JSON."""
    fn = {"paratrain": _child_paratrain, "naive": _child_naive, "flwr": _child_flwr}[system]
    Path(out_path).write_text(json.dumps(fn(k, rounds, **opts)))


def _ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """paratrain / peer: throughput (median over repetitions of the paired per-repetition
    ratios, each repetition running every arm once) and peak memory."""
    pairs = [a / b for a, b in zip(ours["client_updates_per_s_reps"], peer["client_updates_per_s_reps"],
                                   strict=True)]
    out: dict[str, Any] = {
        "throughput_ratio_measured": round(statistics.median(pairs), 3),
        "peak_memory_ratio_measured": round(ours["peak_tree_pss_mb"] / peer["peak_tree_pss_mb"], 3)}
    if len(pairs) > 1:
        out["throughput_ratio_per_repetition_measured"] = [round(v, 3) for v in pairs]
    return out


def _merge(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's result over its repetitions: the first's details, the medians of the figures."""
    out = dict(reps[0])
    out["client_updates_per_s_reps"] = [r["client_updates_per_s"] for r in reps]
    for key in ("client_updates_per_s", "peak_tree_pss_mb", "peak_proc_rss_mb"):
        out[key] = round(statistics.median(r[key] for r in reps), 1)
    if len(reps) > 1:
        out["per_round_updates_per_s"] = [r["per_round_updates_per_s"] for r in reps]
    return out


def _version(dist: str) -> str | None:
    """``dist``'s installed version, or None: looked up, not imported (importing is the
    measured children's work; flwr and Ray cost this process a second of CPU)."""
    from importlib import metadata, util

    if util.find_spec(dist) is None:
        return None
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _flwr_version() -> str | None:
    """Flower's version when its simulation can run (the bench extra, flwr[simulation]: Ray)."""
    return _version("flwr") if _version("ray") is not None else None


FLWR_QUICK_MAX_CLIENTS = 100


def main() -> None:
    ap = argparse.ArgumentParser()
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="100 and 1,000 clients (Flower's simulation at 100 only), 11 rounds (10 timed), "
                           "every arm 3 times: make bench")
    size.add_argument("--smoke", action="store_true",
                      help="10 clients, 2 rounds (1 timed), 1 Ray actor, memory sampled every 1 s: every "
                           "arm that can run, in seconds (Flower's simulation starts Ray: about 10 s more)")
    ap.add_argument("--clients", type=int, nargs="+", help="client counts (default 100 1000)")
    ap.add_argument("--rounds", type=int, help="rounds per run (default 11; the first is not timed)")
    ap.add_argument("--systems", default="paratrain,naive,flwr",
                    help="comma-separated arms among paratrain, naive, flwr (flwr: when importable)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every arm this many times, interleaved; figures are medians and the "
                         "ratios the medians of the paired per-repetition ratios")
    ap.add_argument("--checkpoint-every", action="append", default=[], metavar="CADENCE",
                    help="also a paratrain arm with run.checkpoint_every = CADENCE (e.g. 1h: only "
                         "the last round's checkpoint); repeatable")
    ap.add_argument("--compare-src", action="append", default=[], metavar="DIR",
                    help="also a paratrain arm importing paratrain from DIR (another checkout's src: "
                         "a paired before/after); repeatable")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.smoke else 11)
    sample_s = 1.0 if args.smoke else 0.05  # memory sampling period (a smoke run's peaks are not read)
    flwr_actors = 1 if args.smoke else 2  # Ray's CPUs, one client actor each
    if args.quick and args.repeat == 1:  # paired medians: one pair read anywhere in 0.8-1.3
        args.repeat = 3
    sizes = tuple(args.clients or ((10,) if args.smoke else (100, 1000)))
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    flwr_version = _flwr_version() if "flwr" in systems else None
    if "flwr" in systems and flwr_version is None:  # a comparison that silently vanishes rots
        raise SystemExit("benchmarks/federated.py: the flwr arm needs flwr[simulation] (Ray): "
                         "install the bench extra (make test and make bench do), or leave it "
                         "out with --systems paratrain,naive")
    out: dict[str, Any] = {
        "workload": "digits MLP 64-64-10, IID, all clients every round, E=1, B=10, SGD lr 0.1, "
                    "FedAvg, 2 worker processes / 2 CPUs; every system evaluates the global model "
                    "on the test split after every round",
        "config": {"rounds": rounds, "repetitions": args.repeat, "clients": list(sizes),
                   "cpus": os.cpu_count()},
        "throughput": "client updates / round wall time, median over rounds excluding round 1; "
                      "paratrain's round includes its metrics log and checkpoint write (every round "
                      "unless the arm says otherwise)",
        "provenance_note": "every figure here is measured in this run (timed or sampled); the "
                           "ratios are paratrain / peer of measured medians",
        "memory": f"peak_tree_pss_mb: peak over {sample_s * 1000:g} ms samples of the summed PSS of the system's "
                  "whole process tree (fresh child per system); peak_proc_rss_mb: largest single "
                  "process RSS in that tree",
        "peers": {"naive": "per-client-model PyTorch loop on the same 2 processes, rank 0 "
                           "evaluating the averaged model on the test split each round",
                  "flwr": f"Flower run_simulation (Ray backend, {flwr_actors} CPUs, 1 CPU per client actor), "
                          "evaluate_fn on the test split each round"},
        "versions": {"python": sys.version.split()[0], "torch": _version("torch"), "flwr": flwr_version},
        "loadavg_at_start_measured": [round(v, 2) for v in os.getloadavg()],
        "results": {},
    }
    if flwr_version is not None:
        out["versions"]["ray"] = _version("ray")
    # arms: (label, system, options)
    arms: list[tuple[str, str, dict[str, Any]]] = []
    if "paratrain" in systems:
        arms.append(("paratrain", "paratrain", {}))
        arms += [(f"paratrain_checkpoint_every_{c}", "paratrain",
                  {"checkpoint_every": int(c) if c.isdigit() else c}) for c in args.checkpoint_every]
        arms += [(f"paratrain@{Path(d).resolve().parent.name}/{Path(d).name}", "paratrain",
                  {"src": str(Path(d).resolve())}) for d in args.compare_src]
    if "naive" in systems:
        arms.append(("naive", "naive", {}))
    if flwr_version is not None:
        arms.append(("flwr", "flwr", {"actors": flwr_actors}))
    for k in sizes:
        # --quick: Flower's simulation at 100 clients only (its in-memory LinkState is O(K^2) a
        # round: minutes a round at 1,000); paratrain and the naive loop at both sizes
        arms_k = [a for a in arms if a[1] != "flwr" or not args.quick or k <= FLWR_QUICK_MAX_CLIENTS]
        reps: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in arms_k}
        errors: dict[str, str] = {}
        for rep in range(args.repeat):
            order = arms_k if rep % 2 == 0 else arms_k[::-1]  # alternate: no arm always runs first
            for label, system, opts in order:
                if label in errors:
                    continue
                try:
                    reps[label].append(_run_child(system, k, rounds, sample_s=sample_s, **opts))
                except RuntimeError as exc:
                    if system != "flwr":
                        raise
                    errors[label] = str(exc)[-1500:]
        row: dict[str, Any] = {label: _merge(r) for label, r in reps.items() if r}
        row.update({label: {"error": e} for label, e in errors.items()})
        if "naive" in row:
            for label, _, _ in arms_k:
                if label.startswith("paratrain") and label in row:
                    key = "vs_naive" if label == "paratrain" else f"{label}_vs_naive"
                    row[key] = _ratios(row[label], row["naive"])
        if "paratrain" in row and "client_updates_per_s_reps" in row.get("flwr", {}):
            row["vs_flwr"] = _ratios(row["paratrain"], row["flwr"])
        out["results"][str(k)] = row
    out["provenance"] = provenance(out["results"])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
