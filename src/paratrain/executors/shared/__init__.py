"""Parts several executors run, on a floor below them (the executors do not import each
other: import-linter's ``executors`` independence contract):

- :mod:`.zero`, :mod:`.zero_plan`, :mod:`.zero_shards`: ZeRO (``strategy.shard``), each
  replica stepping its 1/N rows of every parameter: DataParallel's replicas, a
  tensor-parallel mesh's dp columns, a ModelParallel replicated stage;
- :mod:`.replicas`: what data-parallel replicas share (DataParallel, tensor parallelism):
  the job's gradient compressor, the training rows a step of replicas takes.
"""
