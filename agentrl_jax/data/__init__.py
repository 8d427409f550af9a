"""agentrl_jax.data: grain task sources, difficulty-band and bug-type-balanced sampling.

See `pipeline.TaskPipeline` for how the pieces fit together.
"""

from agentrl_jax.data.difficulty import (
    SuccessTracker,
    accept_probability,
    bucket_key,
    estimate,
    in_band,
    is_informative,
    split_informative,
    update_from_groups,
    update_tracker,
)
from agentrl_jax.data.diversity import bug_type_metrics, round_robin, stratum, type_counts
from agentrl_jax.data.pipeline import DataConfig, TaskPipeline
from agentrl_jax.data.sources import (
    SPLITS,
    TaskSpecSource,
    make_task_factory,
    split_cells,
    task_dataset,
    task_iterator,
)
from agentrl_jax.data.transforms import AttachBucket, InBand, InformativeGroup, MakeTask

__all__ = [
    "SPLITS",
    "AttachBucket",
    "DataConfig",
    "InBand",
    "InformativeGroup",
    "MakeTask",
    "SuccessTracker",
    "TaskPipeline",
    "TaskSpecSource",
    "accept_probability",
    "bucket_key",
    "bug_type_metrics",
    "estimate",
    "in_band",
    "is_informative",
    "make_task_factory",
    "round_robin",
    "split_cells",
    "split_informative",
    "stratum",
    "task_dataset",
    "task_iterator",
    "type_counts",
    "update_from_groups",
    "update_tracker",
]
