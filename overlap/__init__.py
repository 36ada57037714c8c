"""triton-overlap: hide the communication of sharded training behind compute.

Collectives return at once and wait right before their first use (``overlap.all_gather`` ...);
packing runs as fused Triton kernels (``overlap_kernels``); the scheduler decides where waits go
(``scheduler``).
"""
from overlap.collectives import (
    all_gather,
    all_gather_coalesced,
    all_reduce,
    all_to_all,
    broadcast,
    reduce_scatter,
    reduce_scatter_coalesced,
    wait,
)
from overlap.checkpoint import CheckpointLoadError, load_checkpoint
from overlap.compression import Compression
from overlap.desync import DesyncError, debug, debug_enabled, set_debug
from overlap.device_info import DeviceInfo, device_info
from overlap.errors import CollectiveError, CollectiveTimeoutError, set_wait_timeout, wait_timeout
from overlap.finite_check import NonFiniteError, check_finite, check_finite_enabled, set_check_finite
from overlap.fsdp_module import UnshardHandle
from overlap.gradient_error import (
    GradientError,
    measure_gradient_error,
    relative_gradient_error,
    set_measure_gradient_error,
    take_gradient_errors,
)
from overlap.fsdp2_api import fully_shard, register_fsdp_forward_method, share_comm_ctx
from overlap.inflight_work import (
    inflight,
    inflight_bytes,
    max_inflight_bytes,
    set_max_inflight_bytes,
    wait_all,
)
from overlap.local_optimizer_step import local_optimizer_step_enabled, set_local_optimizer_step
from overlap.mixed_precision import MixedPrecision
from overlap.optimizer_in_backward import OptimizerInBackward, optimizer_in_backward
from overlap.profiler import Profiler, profile
from overlap.sharding import ShardedModule, no_overlap, no_sync, prefetch_next_step, shard
from overlap.state_dict import full_state_dict, load_full_state_dict
from overlap.tensor_parallelism import tensor_parallel
from overlap.wrap import Wrapped, exclude_from_ddp, wrap
from scheduler.async_tensor import AsyncTensor

FSDPModule = ShardedModule
"""The class every module sharded by ``fully_shard`` / ``shard`` is an instance of, under FSDP2's name
(not torch's ``FSDPModule``: see [Note: not a subclass of torch's FSDPModule] in ``overlap/fsdp_module.py``)."""

__all__ = [
    "AsyncTensor",
    "CheckpointLoadError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Compression",
    "DesyncError",
    "DeviceInfo",
    "FSDPModule",
    "MixedPrecision",
    "NonFiniteError",
    "OptimizerInBackward",
    "Profiler",
    "ShardedModule",
    "UnshardHandle",
    "Wrapped",
    "full_state_dict",
    "fully_shard",
    "load_checkpoint",
    "load_full_state_dict",
    "local_optimizer_step_enabled",
    "no_overlap",
    "no_sync",
    "optimizer_in_backward",
    "prefetch_next_step",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "shard",
    "tensor_parallel",
    "wrap",
    "all_gather",
    "all_gather_coalesced",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "check_finite",
    "check_finite_enabled",
    "debug",
    "debug_enabled",
    "exclude_from_ddp",
    "device_info",
    "inflight",
    "inflight_bytes",
    "max_inflight_bytes",
    "profile",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "set_check_finite",
    "set_measure_gradient_error",
    "take_gradient_errors",
    "relative_gradient_error",
    "measure_gradient_error",
    "GradientError",
    "set_debug",
    "set_local_optimizer_step",
    "set_max_inflight_bytes",
    "set_wait_timeout",
    "wait",
    "wait_all",
    "wait_timeout",
]
