"""triton-overlap: hide the communication of sharded training behind compute.

Collectives return at once and wait right before their first use (``overlap.all_gather`` ...);
packing runs as fused Triton kernels (``kernels``); the scheduler decides where waits go
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
from overlap.device_info import DeviceInfo, device_info
from overlap.inflight_work import inflight, inflight_bytes, wait_all
from overlap.mixed_precision import MixedPrecision
from overlap.sharding import ShardedModule, no_overlap, no_sync, shard
from overlap.state_dict import full_state_dict, load_full_state_dict
from overlap.wrap import Wrapped, wrap
from scheduler.async_tensor import AsyncTensor

__all__ = [
    "AsyncTensor",
    "DeviceInfo",
    "MixedPrecision",
    "ShardedModule",
    "Wrapped",
    "full_state_dict",
    "load_full_state_dict",
    "no_overlap",
    "no_sync",
    "shard",
    "wrap",
    "all_gather",
    "all_gather_coalesced",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "device_info",
    "inflight",
    "inflight_bytes",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "wait",
    "wait_all",
]
