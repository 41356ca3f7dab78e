"""The tables of the run configuration: each a group of settings with its types, defaults and
meaning (`milepost train --help` prints the descriptions). `TrainConfig` (config.py) inherits them
all; a recipe's [table] headers only organize keys, and `TABLE_OF` says where each key lives.
"""

from __future__ import annotations

from milepost.config_tables.base import (
    BUILTIN_ESTIMATORS,
    BUILTIN_REWARDS,
    IMPORT_PATH,
    MIB,
    RESOLVED_NAME,
    Table,
)
from milepost.config_tables.data import (
    AgentTable,
    DataTable,
    DebugTable,
    EvalTable,
    FullyAsyncTable,
    RolloutTable,
)
from milepost.config_tables.precision import PrecisionTable
from milepost.config_tables.run import (
    EngineTable,
    MemoryTable,
    ModelTable,
    PlacementTable,
)
from milepost.config_tables.training import (
    AlgorithmTable,
    CheckpointTable,
    LoggingTable,
    LoraTable,
    OpdTable,
    OptimizerTable,
    WeightsTable,
)

__all__ = [
    "BUILTIN_ESTIMATORS",
    "BUILTIN_REWARDS",
    "IMPORT_PATH",
    "MIB",
    "RESOLVED_NAME",
    "TABLES",
    "TABLE_OF",
    "AgentTable",
    "AlgorithmTable",
    "CheckpointTable",
    "DataTable",
    "DebugTable",
    "EngineTable",
    "EvalTable",
    "FullyAsyncTable",
    "LoggingTable",
    "LoraTable",
    "MemoryTable",
    "ModelTable",
    "OpdTable",
    "OptimizerTable",
    "PlacementTable",
    "PrecisionTable",
    "RolloutTable",
    "Table",
    "WeightsTable",
]

TABLES: dict[str, type[Table]] = {
    "model": ModelTable,
    "placement": PlacementTable,
    "memory": MemoryTable,
    "engine": EngineTable,
    "data": DataTable,
    "rollout": RolloutTable,
    "fully_async": FullyAsyncTable,
    "algorithm": AlgorithmTable,
    "optimizer": OptimizerTable,
    "checkpoint": CheckpointTable,
    "weights": WeightsTable,
    "logging": LoggingTable,
    "eval": EvalTable,
    "debug": DebugTable,
    "agent": AgentTable,
    "opd": OpdTable,
    "lora": LoraTable,
    "precision": PrecisionTable,
}
TABLE_OF: dict[str, str] = {name: t for t, cls in TABLES.items() for name in cls.model_fields}
