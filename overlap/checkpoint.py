"""Loading a DCP checkpoint that never half-applies: ``overlap.load_checkpoint``.

``torch.distributed.checkpoint.load`` reads in place: a checkpoint that fails half way (a truncated
file, a key or shape that does not match) raises after some parameters and optimizer states were
already overwritten. ``load_checkpoint`` takes the same arguments and does the same load, in steps:

1. **check** the target against the checkpoint's metadata (``.metadata``): every key present, each
   tensor's global shape and dtype as saved;
2. **agree** on the outcome across the ranks of ``process_group`` (a flag all-reduced: every rank
   learns which ranks failed);
3. **read** into staging tensors, fresh tensors with the targets' specs (a DTensor gets a DTensor of
   the same mesh, placements and shape, so DCP reshards into it as into the target), verifying
   each record's CRC32 as it is read (see [Note: what a checkpoint read can detect]);
4. **agree** again;
5. only then **copy** the staged values into the targets (and assign the non-tensor values), and
   call ``load_state_dict`` of the ``Stateful`` entries as ``dcp.load`` does.

If any rank fails in 1 or 3, every rank raises :class:`CheckpointLoadError` naming the failing ranks
(a failing rank also says why) and nothing is written anywhere.

Cost: the staging tensors, one extra copy of what this rank loads (its shards: the size of its
share of the checkpoint) until the load returns; the CRC check reads this rank's records a second
time (from the page cache, usually). ``staged=False`` is ``dcp.load`` itself: no extra memory, no
check, and a failure may leave the state half-loaded.

[Note: what a checkpoint read can detect]
DCP's ``FileSystemReader`` stores each tensor as a ``torch.save`` record at an offset and length
in a ``.distcp`` file, and its metadata holds each tensor's global shape and dtype, no checksum.
Checked on torch 2.13 (2.11 and 2.15 read identically): a truncated file raises inside
``dcp.load`` (after other tensors may have been written); a flipped bit in a tensor's bytes loads
silently with the wrong value. But ``torch.save`` writes a zip archive with a CRC32 per record
(``torch.serialization.get_crc32_options()``, on by default) that ``torch.load`` does not verify on
this path. ``load_checkpoint`` verifies it (Python's ``zipfile``) for every record this rank reads
from a ``FileSystemReader``: a flipped bit anywhere in a record's data, a record cut short, or a
damaged zip header raises. Not detected: records of a checkpoint written with
``set_crc32_options(False)`` (they fail verification: load them with ``staged=False``), records
behind a storage transform (compression extensions) or read by another ``StorageReader`` (not
verified), a flip in ``.metadata`` that still unpickles to valid sizes and offsets, and a
checkpoint that is intact but not the one meant.
"""
from __future__ import annotations

import copy
import io
import os
import zipfile
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

# DCP's own flattening (private, identical in torch 2.11-2.15): the keys its metadata uses.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from overlap import agreement
from overlap.groups import resolve_group
from overlap.param_group import _local

__all__ = ["CheckpointLoadError", "load_checkpoint"]


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded on some rank; nothing was written on any rank.

    ``failed_ranks`` lists the ranks (of the load's process group) that failed.
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


def load_checkpoint(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: "str | os.PathLike | None" = None,
    storage_reader: Optional[StorageReader] = None,
    planner: Optional[LoadPlanner] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    no_dist: bool = False,
    staged: bool = True,
) -> None:
    """``dcp.load(state_dict, ...)`` that either loads everything or changes nothing, on every rank.

    Takes ``dcp.load``'s arguments (``state_dict`` as returned by ``model.state_dict()`` or
    ``get_state_dict(model, optimizer)``, nested dicts of tensors, DTensors, other values and
    ``Stateful`` objects) and loads in place as it does, after checking the checkpoint and agreeing
    across ranks (see the module docstring). Every rank of ``process_group`` must call it. Raises
    :class:`CheckpointLoadError` on every rank, with every target unchanged, when a key is missing,
    a shape or dtype differs from the checkpoint's, a file is missing, truncated or fails its CRC32,
    on any rank. ``staged=False``: plain ``dcp.load`` (no extra memory; may half-apply).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_checkpoint: state_dict must be a dict (as dcp.load takes), got "
                        f"{type(state_dict).__name__}")
    if not isinstance(staged, bool):
        raise TypeError(f"load_checkpoint: staged must be a bool, got {staged!r}")
    if not isinstance(no_dist, bool):
        raise TypeError(f"load_checkpoint: no_dist must be a bool, got {no_dist!r}")
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("load_checkpoint: pass checkpoint_id (a checkpoint directory) or storage_reader")
    if storage_reader is not None and not isinstance(storage_reader, StorageReader):
        raise TypeError(f"load_checkpoint: storage_reader must be a torch.distributed.checkpoint.StorageReader, "
                        f"got {type(storage_reader).__name__}")
    if planner is not None and not isinstance(planner, LoadPlanner):
        raise TypeError(f"load_checkpoint: planner must be a torch.distributed.checkpoint.LoadPlanner, got "
                        f"{type(planner).__name__}")
    if not staged:
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader, planner=planner,
                 process_group=process_group, no_dist=no_dist)
        return
    if storage_reader is None:
        storage_reader = FileSystemReader(checkpoint_id)  # what dcp.load picks for a directory

    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    # As dcp.load: a Stateful entry is loaded through its state_dict() and load_state_dict().
    resolved = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    flat, paths = flatten_state_dict(resolved)

    problem = _check_against_metadata(flat, storage_reader, checkpoint_id)
    _agree(problem, "checking the checkpoint's metadata", process_group, distributed)

    staging = {k: _staging_copy(v) for k, v in flat.items()}
    problem = None
    verify_off = _verify_records(storage_reader)
    try:
        dcp.load(staging, checkpoint_id=checkpoint_id, storage_reader=storage_reader, planner=planner,
                 process_group=process_group, no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        problem = f"reading the checkpoint failed: {_first_line(e)}"
    finally:
        verify_off()
    _agree(problem, "reading the checkpoint", process_group, distributed)

    with torch.no_grad():
        for key, value in flat.items():
            new = staging[key]
            if isinstance(value, torch.Tensor):
                _local(value).copy_(_local(new))
            else:
                _set_path(resolved, paths[key], new)
    for key, value in state_dict.items():  # as dcp.load does
        if isinstance(value, Stateful):
            value.load_state_dict(resolved[key])
        else:
            state_dict[key] = resolved[key]


def _staging_copy(value: Any) -> Any:
    """An uninitialized tensor with ``value``'s spec (DTensor: mesh, placements, global shape and
    stride), which DCP fills; other values are deep-copied (DCP replaces them with the saved ones)."""
    if isinstance(value, DTensor):
        local = torch.empty_like(value._local_tensor)  # type: ignore[attr-defined]
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value.detach())
    return copy.deepcopy(value)


def _set_path(root: Any, path: tuple, value: Any) -> None:
    """Assign ``value`` at ``path`` (DCP's flattening path: dict keys and list indices) in ``root``."""
    container = root
    for step in path[:-1]:
        container = container[step]
    container[path[-1]] = value


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # DCP's CheckpointException carries each rank's traceback; the last line of each is its error.
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = lines[-1] if lines else ""
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__


def _check_against_metadata(flat: dict[str, Any], reader: StorageReader, checkpoint_id: Any) -> Optional[str]:
    """What in ``flat`` cannot be loaded from the checkpoint (None: nothing); reads ``.metadata``."""
    try:
        if checkpoint_id is not None:
            reader.reset(checkpoint_id)
        metadata: Metadata = reader.read_metadata()
    except (Exception, CheckpointException) as e:
        return f"reading the checkpoint's metadata failed: {_first_line(e)}"
    saved = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            problems.append(f"key {key!r} is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"{key!r} is a tensor here but not in the checkpoint")
                continue
            if tuple(md.size) != tuple(value.shape):
                problems.append(f"{key!r} has shape {tuple(value.shape)} here, {tuple(md.size)} in the checkpoint")
            if md.properties.dtype != value.dtype:
                problems.append(f"{key!r} is {value.dtype} here, {md.properties.dtype} in the checkpoint")
        elif isinstance(md, TensorStorageMetadata):
            problems.append(f"{key!r} is a {type(value).__name__} here, a tensor in the checkpoint")
    if not problems:
        return None
    shown = problems[:8] + ([f"and {len(problems) - 8} more"] if len(problems) > 8 else [])
    return "the checkpoint does not match: " + "; ".join(shown)


def _agree(problem: Optional[str], stage: str, group: Optional[dist.ProcessGroup], distributed: bool) -> None:
    """Raise :class:`CheckpointLoadError` on every rank if ``problem`` is set on any rank: one
    agreement of ``overlap.agreement`` over ``group`` (bounded by the wait timeout like every
    other), after which every rank knows each failing rank's reason."""
    problems: list[Optional[str]] = [problem]
    if distributed:
        info = resolve_group(group)
        problems = agreement.exchange(info, f"checkpoint {stage}", problem)
    failed = tuple(r for r, p in enumerate(problems) if p is not None)
    if not failed:
        return
    ranks = ", ".join(str(r) for r in failed)
    head = f"overlap.load_checkpoint: nothing was loaded, every state is unchanged: {stage} failed on rank(s) {ranks}"
    reasons = "; ".join(f"rank {r}: {problems[r]}" for r in failed)
    raise CheckpointLoadError(f"{head}. {reasons}", failed)


def _verify_records(reader: StorageReader) -> Any:
    """Make ``reader`` (a ``FileSystemReader``) check each record's CRC32 before DCP reads it; returns
    the function that undoes it. Other readers are left as they are (see [Note: what a checkpoint
    read can detect])."""
    if not isinstance(reader, FileSystemReader):
        return lambda: None
    read_data = reader.read_data

    def verified_read_data(plan: Any, planner: Any) -> Any:
        _check_records(reader, plan)
        return read_data(plan, planner)

    reader.read_data = verified_read_data  # type: ignore[method-assign]
    return lambda: reader.__dict__.pop("read_data", None)


_ZIP_MAGIC = b"PK\x03\x04"


def _check_records(reader: FileSystemReader, plan: Any) -> None:
    """Raise ``ValueError`` naming the file and key of the first record of ``plan`` that is cut short
    or fails its CRC32."""
    seen: set[tuple[str, int, int]] = set()
    for item in plan.items:
        info = reader.storage_data[item.storage_index]
        where = (info.relative_path, info.offset, info.length)
        if where in seen or info.transform_descriptors:
            continue
        seen.add(where)
        path = reader.fs.concat_path(reader.path, info.relative_path)
        with reader.fs.create_stream(path, "rb") as stream:
            stream.seek(info.offset)
            data = stream.read(info.length)
        name = f"{item.storage_index.fqn!r} in {info.relative_path}"
        if len(data) < info.length:
            raise ValueError(f"the record of {name} is cut short: {len(data)} of {info.length} bytes "
                             f"(the file is truncated)")
        if item.type == LoadItemType.BYTE_IO and not data.startswith(_ZIP_MAGIC):
            continue  # raw bytes a user saved, not a torch.save record: nothing to verify
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as e:
            raise ValueError(f"the record of {name} is damaged ({e})") from None
        if bad is not None:
            raise ValueError(f"the record of {name} fails its CRC32 check (member {bad!r}): the file is "
                             f"corrupted (or was saved with torch.serialization.set_crc32_options(False): "
                             f"load it with staged=False)")
