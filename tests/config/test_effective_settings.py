"""Effective settings: what a job sets that its run ignores is reported (validate prints
warnings, run warns once), values the run clamps are given with their effective value,
and factories replace the default model/data name in TOML."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from paratrain.cli import main
from paratrain.config import ConfigError, load_compression, load_strategy
from paratrain.config._base import unknown_keys
from paratrain.config.effective import IgnoredSettingWarning
from paratrain.config.job import load_job
from paratrain.dispatch import effective_settings, execute
from paratrain.executors import register_coordinator

ROOT = Path(__file__).resolve().parents[2]

DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
MP = {"type": "ModelParallel", "partitions": [], "communication": {"protocol": "Direct"}}
FED = {"type": "Federated", "num_clients": 4, "rounds": 2, "aggregation": {"method": "FedAvg"},
       "client_selection": {"method": "All"}}
PBT = {"type": "PopulationBased", "population_size": 2, "generations": 1,
       "exploit": {"method": "Truncation", "fraction": 0.5},
       "explore": {"method": "Perturbation", "factor": 0.2}}
CUSTOM = {"type": "Custom", "coordinator": "eff-plain", "config": None}
TOPK = {"method": "TopK", "k": 8}
SPACE = {"lr": {"type": "log_uniform", "low": 0.01, "high": 0.5}}


def _ignored(doc: dict[str, Any], **kw: Any) -> dict[str, str]:
    return {i.field: i.reason for i in effective_settings(load_job(doc), **kw).ignored}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------- defaults: silent


def test_a_default_job_and_full_dumps_have_no_ignored_settings() -> None:
    for doc in ({}, {"strategy": DP}, {"strategy": FED}, {"strategy": PBT, "search_space": SPACE},
                {"strategy": DP, "compression": TOPK}, {"strategy": FED, "compression": TOPK}):
        job = load_job(doc)
        assert effective_settings(job).ignored == [], doc
        # a job dumped in full (runs/<name>/job.json) sets every field explicitly
        again = load_job(job.to_json_dict())
        assert again == job
        assert effective_settings(again).ignored == [], doc


def test_validate_examples_print_no_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
    assert examples
    assert main(["validate", *examples]) == 0
    out = capsys.readouterr()
    assert "warning" not in out.err, out.err
    assert out.out.count(": ok") == len(examples)


# ------------------------------------------------------------------- [compression]


@pytest.mark.parametrize("strategy", [{"type": "Local"}, MP, PBT], ids=["Local", "ModelParallel", "PBT"])
def test_compression_ignored_without_an_exchange(strategy: dict[str, Any]) -> None:
    got = _ignored({"strategy": strategy, "compression": TOPK})
    assert "compression" in got and "compress" in got["compression"]


@pytest.mark.parametrize("strategy", [DP, FED, CUSTOM], ids=["DataParallel", "Federated", "Custom"])
def test_compression_effective_where_something_is_exchanged(strategy: dict[str, Any]) -> None:
    eff = effective_settings(load_job({"strategy": strategy, "compression": TOPK}))
    assert eff.ignored == []
    assert eff.settings["compression"] == TOPK


def test_custom_coordinator_receives_the_whole_job_compression_included(tmp_path: Path) -> None:
    seen: list[Any] = []

    @register_coordinator("eff-sees-job")
    def _coord(job, config):  # type: ignore[no-untyped-def]
        seen.append(job.compression)
        return {"strategy": "Custom"}

    job = load_job({"run": {"output_dir": str(tmp_path)}, "compression": TOPK,
                    "strategy": {"type": "Custom", "coordinator": "eff-sees-job", "config": {}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        execute(job)
    assert seen and seen[0].method == "TopK" and seen[0].k == 8


# --------------------------------------------------------------- [tensor_parallel]


# (ModelParallel refuses tensor_parallel_size > 1: tests/executors/tensor_parallel/test_mesh_zero_tp.py)
@pytest.mark.parametrize("strategy", [FED, PBT], ids=["Federated", "PBT"])
def test_tensor_parallel_ignored_by_strategies_without_it(strategy: dict[str, Any]) -> None:
    got = _ignored({"strategy": strategy, "tensor_parallel": {"tensor_parallel_size": 2}})
    assert "no tensor parallelism" in got["tensor_parallel"]


def test_tensor_parallel_size_one_is_ignored() -> None:
    got = _ignored({"tensor_parallel": {"tensor_parallel_size": 1, "mixed_precision": True}})
    assert "tensor_parallel_size = 1" in got["tensor_parallel"]
    eff = effective_settings(load_job({"tensor_parallel": {"tensor_parallel_size": 1}}))
    assert eff.settings["tensor_parallel"] is None and eff.settings["executor"] == "Local"


def test_blockwise_on_a_non_square_size_runs_columnwise() -> None:
    tp = {"tensor_parallel_size": 2, "partitioning_strategy": "BlockWise"}
    eff = effective_settings(load_job({"tensor_parallel": tp}))
    reasons = {i.field: i.reason for i in eff.ignored}
    assert "ColumnWise" in reasons["tensor_parallel.partitioning_strategy"]
    assert eff.settings["tensor_parallel"]["partitioning_strategy"] == "ColumnWise"
    square = effective_settings(load_job({"tensor_parallel": {**tp, "tensor_parallel_size": 4}}))
    assert square.ignored == []
    assert square.settings["tensor_parallel"]["partitioning_strategy"] == "BlockWise"


def test_memory_level_equal_to_another_on_this_model() -> None:
    # mlp hidden [64, 64] on 2 ranks: 2 checkpoint blocks, so Low (segments of 4) = Medium (2)
    doc = {"model": {"name": "mlp", "hidden": [64, 64]},
           "tensor_parallel": {"tensor_parallel_size": 2, "memory_optimization": "Low"}}
    got = _ignored(doc)
    assert "Medium" in got["tensor_parallel.memory_optimization"]
    assert "2 checkpoint block" in got["tensor_parallel.memory_optimization"]
    # three hidden layers: 3 blocks, Low / Medium / High checkpoint different segments
    doc["model"] = {"name": "mlp", "hidden": [64, 64, 64]}
    assert "tensor_parallel.memory_optimization" not in _ignored(doc)
    # None is never the same as a checkpointing level
    doc["tensor_parallel"]["memory_optimization"] = "None"
    assert "tensor_parallel.memory_optimization" not in _ignored(doc)


def test_extreme_without_accelerator_equals_high() -> None:
    doc = {"run": {"device": "cpu"}, "model": {"name": "mlp", "hidden": [64, 64, 64]},
           "tensor_parallel": {"tensor_parallel_size": 2, "memory_optimization": "Extreme"}}
    reason = _ignored(doc)["tensor_parallel.memory_optimization"]
    assert "High" in reason and "accelerator" in reason


def test_fusion_threshold_with_nothing_to_fuse() -> None:
    doc: dict[str, Any] = {"model": {"name": "mlp", "hidden": [64, 64]},
                           "tensor_parallel": {"tensor_parallel_size": 2,
                                               "fusion_threshold_bytes": 4096}}
    assert "nothing to fuse" in _ignored(doc)["tensor_parallel.fusion_threshold_bytes"]
    # sequence parallel: replicated parameters' gradients are coalesced over the TP group
    doc["tensor_parallel"]["communication_pattern"] = "ReduceScatter"
    assert "tensor_parallel.fusion_threshold_bytes" not in _ignored(doc)
    # DataParallel replicas: the DP gradient average is coalesced
    doc["tensor_parallel"]["communication_pattern"] = "AllReduce"
    assert "tensor_parallel.fusion_threshold_bytes" not in _ignored({**doc, "strategy": DP})


# ------------------------------------------------------ budget fields and sections


@pytest.mark.parametrize("strategy", [FED, PBT], ids=["Federated", "PBT"])
def test_train_budget_and_cadence_ignored_by_round_and_generation_strategies(
    strategy: dict[str, Any],
) -> None:
    doc = {"strategy": strategy, "train": {"epochs": 3, "eval_every": 5, "max_steps": 7},
           "run": {"checkpoint_every": 4, "log_every": 2}}
    got = _ignored(doc)
    for field in ("train.epochs", "train.eval_every", "train.max_steps", "run.log_every"):
        assert field in got, (field, got)
    assert "train.batch_size" not in got  # left at its default
    # Federated checkpoints every N rounds (or a wall time); a PBT generation is its unit
    assert ("run.checkpoint_every" in got) is (strategy is PBT), got
    if strategy is PBT:
        assert "every generation" in got["run.checkpoint_every"]
    else:
        assert effective_settings(load_job(doc)).settings["checkpoint_every"] == 4


def test_federated_clients_use_their_own_batch_size() -> None:
    assert "federated.batch_size" in _ignored({"strategy": FED, "train": {"batch_size": 64}})["train.batch_size"]


@pytest.mark.parametrize(
    ("section", "value", "owner"),
    [("federated", {"local_epochs": 3}, "Federated"),
     ("population", {"metric": "loss"}, "PopulationBased"),
     ("search_space", SPACE, "PopulationBased")],
)
@pytest.mark.parametrize("strategy", [{"type": "Local"}, DP], ids=["Local", "DataParallel"])
def test_strategy_sections_ignored_elsewhere(
    section: str, value: dict[str, Any], owner: str, strategy: dict[str, Any],
) -> None:
    got = _ignored({"strategy": strategy, section: value})
    assert owner in got[section]
    assert _ignored({"strategy": CUSTOM, section: value}) == {}  # the coordinator's to use


def test_validate_prints_warnings_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "j.toml", """
        [strategy]
        type = "Local"

        [compression]
        method = "TopK"
        k = 10

        [federated]
        local_epochs = 2
        """)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line]
    assert f"{path}: warning: compression ignored:" in out.err
    assert f"{path}: warning: federated ignored:" in out.err and "local_epochs" in out.err
    assert len(lines) == 2 and all(line.startswith(f"{path}: warning: ") for line in lines)
    assert f"{path}: ok" in out.out


# ------------------------------------------------------------------ Custom --resume

calls: list[dict[str, Any]] = []


@register_coordinator("eff-plain")
def _plain(job, config):  # type: ignore[no-untyped-def]
    calls.append({"name": "plain"})
    return {"strategy": "Custom"}


@register_coordinator("eff-resumable")
def _resumable(job, config, *, resume=False):  # type: ignore[no-untyped-def]
    calls.append({"name": "resumable", "resume": resume})
    return {"strategy": "Custom"}


def _custom_job(tmp_path: Path, name: str) -> Any:
    return load_job({"run": {"output_dir": str(tmp_path)},
                     "strategy": {"type": "Custom", "coordinator": name, "config": None}})


def test_resume_reaches_a_coordinator_that_takes_it(tmp_path: Path) -> None:
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        execute(_custom_job(tmp_path, "eff-resumable"), resume=True)
        execute(_custom_job(tmp_path, "eff-resumable"))
    assert calls == [{"name": "resumable", "resume": True}, {"name": "resumable", "resume": False}]
    eff = effective_settings(_custom_job(tmp_path, "eff-resumable"), resume=True)
    assert eff.ignored == [] and eff.settings["resume"] is True


def test_resume_for_an_old_coordinator_is_warned_once_and_it_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    calls.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        execute(_custom_job(tmp_path, "eff-plain"), resume=True)
    assert calls == [{"name": "plain"}]
    mine = [w for w in caught if issubclass(w.category, IgnoredSettingWarning)]
    assert len(mine) == 1 and "--resume" in str(mine[0].message)
    assert "eff-plain" in str(mine[0].message)
    # only the launching process warns: other torchrun ranks stay quiet
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        execute(_custom_job(tmp_path, "eff-plain"), resume=True)
    assert not [w for w in caught if issubclass(w.category, IgnoredSettingWarning)]


def test_run_warns_once_for_an_ignored_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    path = _write(tmp_path, "w.toml", f"""
        [run]
        name = "warned"
        output_dir = "{tmp_path / 'runs'}"

        [model]
        name = "mlp"
        hidden = [16]

        [train]
        epochs = 1
        max_steps = 2

        [population]
        metric = "loss"
        """)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["run", str(path), "-q"]) == 0
    mine = [str(w.message) for w in caught if issubclass(w.category, IgnoredSettingWarning)]
    assert len(mine) == 1 and mine[0].startswith("population")


# ------------------------------------------------------------------------- Krum


def _krum(num_clients: int, selection: dict[str, Any], **krum: int) -> dict[str, Any]:
    return {"strategy": {**FED, "num_clients": num_clients, "client_selection": selection,
                         "aggregation": {"method": "Krum", **krum}}}


def test_krum_out_of_range_warns_with_effective_values() -> None:
    doc = _krum(5, {"method": "All"}, num_malicious=4, to_keep=9)
    eff = effective_settings(load_job(doc))
    got = {i.field: i.reason for i in eff.ignored}
    assert "num_malicious = 2" in got["strategy.aggregation.num_malicious"]
    assert "effective to_keep = 5" in got["strategy.aggregation.to_keep"]
    assert eff.settings["krum"] == {"clients_per_round": 5, "num_malicious": 2, "to_keep": 5}


def test_krum_counts_clients_per_round_of_random_selection() -> None:
    # Random 0.5 of 10 clients = 5 per round: to_keep 5 is in range, 6 is not
    assert _ignored(_krum(10, {"method": "Random", "fraction": 0.5}, num_malicious=2, to_keep=5)) == {}
    got = _ignored(_krum(10, {"method": "Random", "fraction": 0.5}, to_keep=6))
    assert set(got) == {"strategy.aggregation.to_keep"}
    assert "5 client(s) per round" in got["strategy.aggregation.to_keep"]


def test_krum_in_range_is_silent() -> None:
    assert _ignored(_krum(10, {"method": "All"}, num_malicious=3, to_keep=4)) == {}
    assert _ignored(_krum(10, {"method": "All"})) == {}


# -------------------------------------------------------------------- TopK k = 0


def test_topk_k_zero_is_an_error_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_compression({"method": "TopK", "k": 0})
    assert info.value.problems[0][0] == "k"
    path = _write(tmp_path, "k0.toml", """
        [strategy]
        type = "DataParallel"
        num_replicas = 2
        aggregation = { method = "AllReduce" }

        [compression]
        method = "ErrorFeedback"
        error_compensation = true
        base_strategy = { method = "TopK", k = 0 }
        """)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "compression.base_strategy.k" in err and "nothing would be sent" in err
    assert load_compression({"method": "TopK", "k": 1}).k == 1


def test_randomk_k_zero_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        load_compression({"method": "RandomK", "k": 0})
    assert info.value.problems[0][0] == "k" and "nothing would be sent" in info.value.problems[0][1]
    assert load_compression({"method": "RandomK", "k": 1}).k == 1


# ------------------------------------------------------------ lenient unknown keys


def test_unknown_contract_keys_are_listed_with_full_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    doc = {"strategy": {**DP, "aggregation": {"method": "AllReduce", "bucket": 5}, "replicas": 3},
           "compression": {"method": "ErrorFeedback", "error_compensation": True,
                           "base_strategy": {"method": "TopK", "k": 4, "topk": 9}},
           "tensor_parallel": {"tensor_parallel_size": 2, "tp_size": 4}}
    job = load_job(doc)  # still lenient: parsing succeeds and the keys are dropped
    assert job.to_json_dict()["strategy"] == DP
    got = _ignored(doc)
    for field in ("strategy.replicas", "strategy.aggregation.bucket",
                  "compression.base_strategy.topk", "tensor_parallel.tp_size"):
        assert field in got and "unknown key" in got[field], (field, got)
    path = _write(tmp_path, "u.toml", """
        [strategy]
        type = "Local"
        note = "hello"
        """)
    assert main(["validate", str(path)]) == 0
    assert f"{path}: warning: strategy.note ignored: unknown key" in capsys.readouterr().err


def test_unknown_keys_do_not_change_equality_or_hash() -> None:
    a = load_strategy({"type": "Local", "extra": 1})
    b = load_strategy({"type": "Local"})
    assert a == b and hash(a) == hash(b)
    assert unknown_keys(a) == ("extra",) and unknown_keys(b) == ()
    assert unknown_keys(a.model_copy()) == ()


# --------------------------------------------------------- factories in TOML (12.4)

FACTORY = '''
import numpy as np
from torch import nn


def make_model(input_shape, num_classes, width=8):
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, width), nn.ReLU(), nn.Linear(width, num_classes))


def make_data(seed, rows=96):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")
'''


def test_factory_in_toml_replaces_the_default_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tinyfac_eff.py").write_text(FACTORY)
    mod = "paratrain_plugin_tinyfac_eff"
    path = _write(tmp_path, "fac.toml", f"""
        [run]
        name = "fac"
        output_dir = "{tmp_path / 'runs'}"
        imports = ["tinyfac_eff.py"]

        [model]
        factory = "{mod}:make_model"
        width = 12

        [data]
        factory = "{mod}:make_data"
        rows = 80

        [train]
        epochs = 1
        batch_size = 16
        """)
    job = load_job(path)
    assert (job.model.name, job.model.factory, job.model.kwargs) == (None, f"{mod}:make_model", {"width": 12})
    assert (job.data.name, job.data.factory, job.data.kwargs) == (None, f"{mod}:make_data", {"rows": 80})
    assert load_job(job.to_json_dict()) == job
    assert main(["validate", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["run", str(path), "-q"]) == 0  # trains the factory model on the factory data
    assert (tmp_path / "runs" / "fac" / "summary.json").is_file()


@pytest.mark.parametrize("section", ["model", "data"])
def test_name_and_factory_together_is_an_error(section: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job({section: {"name": "mlp" if section == "model" else "digits", "factory": "m:f"}})
    msg = str(info.value)
    assert f"{section}.name" in msg and f"{section}.factory" in msg
    with pytest.raises(ConfigError, match=f"{section}.factory"):
        load_job({section: {"name": None}})
    # an explicit null factory keeps the default name
    assert getattr(load_job({section: {"factory": None}}), section).name is not None
