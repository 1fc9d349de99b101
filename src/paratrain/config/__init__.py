"""The contract: pure data, no torch import (DESIGN §3)."""

from ._base import ConfigError, one_line, parse_every
from .compression import (
    ClippedCompression,
    CompressionStrategy,
    ErrorFeedback,
    NoCompression,
    Quantization,
    RandomK,
    Threshold,
    TopK,
    compression_schema,
    dump_compression,
    load_compression,
)
from .job import JobConfig, job_schema, load_job
from .strategy import (
    Custom,
    DataParallel,
    Federated,
    Local,
    ModelParallel,
    PopulationBased,
    TrainingStrategy,
    dump_strategy,
    load_strategy,
    strategy_schema,
)
from .tensor_parallel import (
    TensorCommunicationPattern,
    TensorMemoryOptimization,
    TensorParallelismConfig,
    TensorPartitioningStrategy,
    dump_tensor_parallel,
    load_tensor_parallel,
)

__all__ = [
    "parse_every",
    "ConfigError", "one_line",
    "ClippedCompression", "CompressionStrategy", "ErrorFeedback", "NoCompression",
    "Quantization", "RandomK", "Threshold", "TopK",
    "compression_schema", "dump_compression", "load_compression",
    "JobConfig", "job_schema", "load_job",
    "Custom", "DataParallel", "Federated", "Local", "ModelParallel", "PopulationBased",
    "TrainingStrategy", "dump_strategy", "load_strategy", "strategy_schema",
    "TensorCommunicationPattern", "TensorMemoryOptimization", "TensorParallelismConfig",
    "TensorPartitioningStrategy", "dump_tensor_parallel", "load_tensor_parallel",
]
