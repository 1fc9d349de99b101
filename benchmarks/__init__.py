"""paratrain's benchmarks (run each as ``python benchmarks/<name>.py``; results in RESULTS.md).

A regular package, so that ``from benchmarks import federated`` finds these and not the
top-level ``benchmarks`` package opacus 1.6.0 installs into site-packages (a namespace
portion loses to a regular package anywhere on ``sys.path``)."""
