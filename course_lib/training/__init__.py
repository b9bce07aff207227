"""Training on several ranks, built on course_lib's hand-written communication.

    sharding          which samples each rank trains on (DistributedSampler's rule, written out)
    data_parallel     train_data_parallel: broadcast, shard, forward/backward, all-reduce, step;
                      train_single_process: the one-process reference it must match
    buckets           gradient buckets all-reduced during backward (overlap=True), and their timeline
    zero              ShardedOptimizer: ZeRO-1, each rank keeps 1/G of the optimizer state
    zero_sharded      ShardedDataParallel: plain DP and ZeRO-1, -2, -3 (FSDP-style) layer by layer
    modeled_compute   ComputeDelay: a layer whose forward and backward take a fixed time (an accelerator's
                      compute, the CPU free meanwhile), to pair with a modeled network
    memory            MemoryCensus: parameter, gradient and optimizer bytes per rank, measured; the
                      Playbook's formulas (model_state_bytes) and the schedule's exact count
    compression       DDP communication hooks that send fewer bytes: bf16/fp16 summed in fp32,
                      PowerSGD and top-k with error feedback (also for train_data_parallel(comm_hook=))
    schedules         name_calls: each collective of a step named in its trace, to draw the step
    ddp               train_ddp: PyTorch's DistributedDataParallel in its five steps;
                      allreduce_hook: course_lib's ring as DDP's communication hook
    parameter_server  train_parameter_server: sync or async, with measured staleness;
                      simulate_stale_sgd: staleness alone, deterministic
    model_parallel    train_model_parallel: layers split over the ranks, activations sent forward
    toy               small data sets and models made in code; a text progress bar

Every `train_*` function runs inside a rank (a function started by `course_lib.launch` or torchrun),
except `train_single_process` and `simulate_stale_sgd`, which need no process group.
"""

from course_lib.training import (
    buckets,
    compression,
    data_parallel,
    ddp,
    memory,
    model_parallel,
    modeled_compute,
    parameter_server,
    schedules,
    sharding,
    toy,
    zero,
    zero_sharded,
)
from course_lib.training.data_parallel import (
    HookBucket,
    TrainingLog,
    apply_reduced_gradient,
    average_gradients,
    batch_norm_note,
    broadcast_buffers,
    broadcast_parameters,
    flat_parameters,
    train_data_parallel,
    train_single_process,
)
from course_lib.training.buckets import BucketTiming, GradientBuckets, StepTimeline, plan_buckets
from course_lib.training.ddp import CommHookState, allreduce_hook, train_ddp
from course_lib.training.model_parallel import PipelineLog, split_sequential, train_model_parallel
from course_lib.training.parameter_server import ServerLog, WorkerLog, simulate_stale_sgd, train_parameter_server
from course_lib.training.sharding import global_batches, shard_indices, split_batches, steps_per_epoch
from course_lib.training.toy import make_mlp, make_regression, make_spirals, progress_bar
from course_lib.training.zero import ShardedOptimizer, optimizer_state_bytes
from course_lib.training.zero_sharded import ShardedDataParallel
from course_lib.training.memory import MemoryCensus, model_state_bytes, schedule_bytes
from course_lib.training.modeled_compute import ComputeDelay, with_compute_delays

__all__ = [
    "sharding", "data_parallel", "buckets", "zero", "zero_sharded", "memory", "compression", "schedules", "ddp",
    "parameter_server",
    "model_parallel", "toy", "modeled_compute", "ComputeDelay", "with_compute_delays",
    "TrainingLog", "flat_parameters", "broadcast_parameters", "broadcast_buffers", "batch_norm_note",
    "average_gradients", "apply_reduced_gradient", "HookBucket",
    "train_data_parallel", "train_single_process",
    "BucketTiming", "StepTimeline", "GradientBuckets", "plan_buckets",
    "ShardedOptimizer", "optimizer_state_bytes", "ShardedDataParallel",
    "MemoryCensus", "model_state_bytes", "schedule_bytes",
    "CommHookState", "allreduce_hook", "train_ddp",
    "ServerLog", "WorkerLog", "train_parameter_server", "simulate_stale_sgd",
    "PipelineLog", "split_sequential", "train_model_parallel",
    "shard_indices", "split_batches", "steps_per_epoch", "global_batches",
    "make_spirals", "make_regression", "make_mlp", "progress_bar",
]
