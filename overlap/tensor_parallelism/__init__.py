"""Tensor parallelism with the communication hidden inside the matmuls (the package behind the
function ``overlap.tensor_parallel``, as ``overlap.sharding`` is behind ``overlap.shard``).

``overlap.tensor_parallel(module, mesh, plan, chunks=None)`` takes torch's ``parallelize_module``
plan (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput`` /
``Output``) and gives the module torch TP's sharding and numerics, with the collectives of its
linear layers cut into chunks that travel while the other chunks' matmuls run.

=======================  ========================================================================
module                   concern
=======================  ========================================================================
``api``                  the entry point: plan resolution and validation, then applying it
``plan``                 which torch style on which module becomes what (or is left to torch)
``layers``               the parallelized ``nn.Linear``: parameters as torch shards them, the
                         decomposed forward on local tensors, DTensors at the boundaries
``collective_matmul``    the decomposed collective matmuls (autograd functions, forward and backward)
``deferred_gather``      a ``PrepareModuleInput``'s gather of a sequence-sharded input, left to the
                         column-parallel layers that read it (torchtitan's attention plan)
``chunks``               how many chunks a collective is cut into
=======================  ========================================================================
"""
from overlap.tensor_parallelism.api import tensor_parallel

__all__ = ["tensor_parallel"]
