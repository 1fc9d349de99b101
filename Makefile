PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q --no-compile -c constraints.txt torch==2.13.0 -e '.[dev,hf,flower,bench,tensorboard,mlflow,wandb,ft]'
	$(BIN)/pip install -q --no-compile --no-deps --upgrade --target $(VENV)/timm timm==1.0.31 torchvision==0.29.1
	$(BIN)/python -c '$(COMPILE)' $(VENV)/lib $(VENV)/timm
	touch $(STAMP)

# pip byte-compiles the ~21k files it installs one at a time (about a third of the install);
# compiled here instead on every core, as pip does it: a file that does not compile on this
# Python (torch ships a 3.12-only test helper) is left as source, silently.
COMPILE := import compileall, sys; [compileall.compile_dir(d, quiet=2, workers=0) for d in sys.argv[1:]]

# timm (and torchvision, which it imports) go into $(VENV)/timm, a folder on no sys.path, not into
# the venv: once torchvision is importable, transformers imports it, and PyPI's torchvision wheel
# cannot load its _C beside the CPU torch ("operator torchvision::nms does not exist"), which breaks
# `import transformers.modeling_utils`. Only tests/tensor_parallel/test_timm_real.py's ranks import
# timm from there (tests/_real_timm.py defines the two torchvision operators first). --no-deps:
# timm's own dependencies (huggingface_hub, safetensors, pyyaml) come with the hf extra;
# --upgrade: a changed pin replaces the folder's copy rather than warning and keeping it.

# The bench extra (Flower's simulation runtime: flwr[simulation], Ray, for benchmarks/federated.py's
# Flower arm) goes into the same venv, so that the suite's smoke run of that arm runs in CI: its
# pins install beside the project's without changing any (Ray 2.55.1 and a few dependencies).
BENCH_STAMP := $(STAMP)

demo: $(STAMP)
	$(BIN)/paratrain run examples/gpt_shakespeare_local.toml --overwrite

# Three pytest workers, whole files per worker (a file's module fixtures launch once; the long
# files first, tests/conftest.py): most tests wait on worker processes, so three files at a time
# fill 2 cores (four, tried on a clean clone the same evening, took 1,175 s in pytest against
# three's 1,152 s: the suite is CPU-bound, and more workers only slow each file).
# --dist loadfile, not loadgroup: pytest 9.2 derives a node id from its parts, so xdist 3.8's
# group suffix is lost and loadgroup spreads every test (a module fixture then ran once per
# worker: the SecAgg+ federations three times, about 14 minutes).
# --durations: CI's log says where the time went.
test: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 src tests
	$(BIN)/python -m pytest -n 3 --dist loadfile --durations=25 tests

# The floors that are mypy --strict clean, and stay so.
STRICT := src/paratrain/config src/paratrain/comm src/paratrain/training src/paratrain/compression src/paratrain/data

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/mypy --strict $(STRICT)
	$(BIN)/lint-imports --no-logo

# Every benchmark at its --quick size, one at a time and niced (the machine is usually
# shared): each result with its provenance in benchmarks/results/<name>.json, then
# benchmarks/RESULTS.md generated from those files (never edited by hand).
# BENCH="zero mesh" runs only those and regenerates RESULTS.md from every results file.
bench: $(BENCH_STAMP)
	nice -n 10 $(BIN)/python benchmarks/_bench.py $(if $(BENCH),--only $(BENCH))

clean:
	rm -rf $(VENV) runs .pytest_cache
