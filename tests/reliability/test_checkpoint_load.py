"""Loading a checkpoint never half-applies (issue 31): ``overlap.load_checkpoint`` on 1 and 2 gloo ranks.

A sharded model and its AdamW state are saved with ``dcp.save`` (``get_state_dict``, as README shows),
trained one more step, then loaded from damaged checkpoints: a truncated file, a flipped bit in a
tensor's bytes, no ``.metadata`` (half-written), a key the checkpoint lacks, a shape or dtype that
differs (on every rank, and on one rank only), one rank's file truncated. Each must raise
``CheckpointLoadError`` on every rank, naming the failing ranks, and leave every parameter and
optimizer state bitwise as it was. A good checkpoint must load bitwise equal to ``dcp.load``'s own
load (checked on a second copy of the model). The reference for "what DCP alone does" is run too: a
flipped bit loads silently with ``dcp.load``, and a truncated file raises after writing. A second
test loads the DCP recipe's ``Stateful`` application state and a non-tensor value over uneven shards,
and damages the non-tensor value's record.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap


def _trained(out_features: int = 6, dtype: torch.dtype = torch.float32, hidden: int = 32,
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, out_features)).to(dtype)
    overlap.shard(model[0])
    overlap.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, seed=1)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    model(x.to(next(model.parameters()).dtype)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _state_dict(model: nn.Module, opt: torch.optim.Optimizer, step: int = 0) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}  # a non-tensor value too


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every local tensor of the parameters and the optimizer state, copied (for bitwise checks)."""
    out = [p.to_local().clone() for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            out.append((value.to_local() if hasattr(value, "to_local") else value).clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _damaged_copy(src: str, dst: str, damage: Callable[[str], None]) -> str:
    """Rank 0 copies the checkpoint and damages the copy; every rank waits for it."""
    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
        damage(dst)
    dist.barrier()
    return dst


def _truncate(name: str) -> Callable[[str], None]:
    def damage(path: str) -> None:
        file = os.path.join(path, name)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) * 2 // 3)
    return damage


def _flip_bit(path: str, fqn: str | None = None) -> None:
    """Flip one bit in the middle of the largest tensor record, or of the record of key ``fqn``
    (inside its data bytes)."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    if fqn is None:
        info = max(storage.values(), key=lambda s: s.length)
    else:
        info = next(info for index, info in storage.items() if index.fqn == fqn)
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)[0]
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte ^ 0x04]))


def _attempt(load: Callable[[], None], model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    before = _snapshot(model, opt)
    try:
        load()
        error, failed = None, None
    except overlap.CheckpointLoadError as e:
        error, failed = str(e), list(e.failed_ranks)
    return {"error": error, "failed": failed, "unchanged": _same(before, _snapshot(model, opt))}


def _rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    good = os.path.join(root, "good")
    saved_model, saved_opt = _trained()
    dcp.save(_state_dict(saved_model, saved_opt, step=7), checkpoint_id=good)
    saved = _snapshot(saved_model, saved_opt)

    model, opt = _trained()
    _step(model, opt, seed=2)  # now differs from the checkpoint
    out: dict[str, Any] = {}

    def load_into(path: str, sd: dict[str, Any] | None = None) -> Callable[[], None]:
        return lambda: overlap.load_checkpoint(sd if sd is not None else _state_dict(model, opt), checkpoint_id=path)

    truncated = _damaged_copy(good, os.path.join(root, "truncated"), _truncate("__0_0.distcp"))
    out["truncated"] = _attempt(load_into(truncated), model, opt)
    flipped = _damaged_copy(good, os.path.join(root, "flipped"), _flip_bit)
    out["flipped"] = _attempt(load_into(flipped), model, opt)
    half = _damaged_copy(good, os.path.join(root, "half"), lambda p: os.remove(os.path.join(p, ".metadata")))
    out["half_written"] = _attempt(load_into(half), model, opt)
    extra = dict(_state_dict(model, opt), scale=torch.zeros(3))
    out["missing_key"] = _attempt(load_into(good, extra), model, opt)
    if world > 1:
        last = _damaged_copy(good, os.path.join(root, "last_rank_file"), _truncate(f"__{world - 1}_0.distcp"))
        out["one_rank_file"] = _attempt(load_into(last), model, opt)
        # Only the last rank's model differs: the others' checks pass, yet they must not load either.
        local_sd = _state_dict(model, opt)
        if rank == world - 1:
            local_sd["model"]["2.bias"] = torch.zeros(1)
        out["one_rank_shape"] = _attempt(load_into(good, local_sd), model, opt)

    other_shape, other_opt = _trained(out_features=5)
    out["wrong_shape"] = _attempt(lambda: overlap.load_checkpoint(_state_dict(other_shape, other_opt),
                                                                  checkpoint_id=good), other_shape, other_opt)
    other_dtype, dtype_opt = _trained(dtype=torch.float64)
    out["wrong_dtype"] = _attempt(lambda: overlap.load_checkpoint(_state_dict(other_dtype, dtype_opt),
                                                                  checkpoint_id=good), other_dtype, dtype_opt)

    # What DCP alone does with the same files (the reference this fixes).
    twin, twin_opt = _trained()
    _step(twin, twin_opt, seed=2)
    try:
        dcp.load(_state_dict(twin, twin_opt), checkpoint_id=flipped)
        out["dcp_flipped_raises"] = False
    except BaseException:  # noqa: BLE001 -- CheckpointException is a BaseException
        out["dcp_flipped_raises"] = True
    out["dcp_flipped_wrong"] = not _same(_snapshot(twin, twin_opt), saved)  # on the rank holding the record

    # A good checkpoint: bitwise what dcp.load gives (then set_state_dict, as README shows).
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ours = _state_dict(model, opt)
    overlap.load_checkpoint(ours, checkpoint_id=good)
    out["step_loaded"] = ours["step"]
    set_state_dict(model, opt, model_state_dict=ours["model"], optim_state_dict=ours["optim"])
    theirs = _state_dict(twin, twin_opt)
    dcp.load(theirs, checkpoint_id=good)
    set_state_dict(twin, twin_opt, model_state_dict=theirs["model"], optim_state_dict=theirs["optim"])
    out["good_equals_dcp"] = _same(_snapshot(model, opt), _snapshot(twin, twin_opt))
    out["good_equals_saved"] = _same(_snapshot(model, opt), saved)
    # and training on from it matches training on from DCP's load
    _step(model, opt, seed=3)
    _step(twin, twin_opt, seed=3)
    out["trains_on_equal"] = _same(_snapshot(model, opt), _snapshot(twin, twin_opt))

    # staged=False is dcp.load: a flipped bit loads silently
    out["unstaged_flipped"] = _attempt(
        lambda: overlap.load_checkpoint(_state_dict(model, opt), checkpoint_id=flipped, staged=False), model, opt)
    return out


def _check(results: list[dict[str, Any]], world: int) -> None:
    every = list(range(world))
    # A read error on one rank reaches every rank through DCP's own gather of read errors, so every
    # rank reports it; a check that fails on one rank only is named by that rank.
    expected = {
        "truncated": (every, "__0_0.distcp is cut short"),
        "flipped": (every, "fails its CRC32 check"),
        "half_written": (every, ".metadata"),
        "missing_key": (every, "key 'scale' is not in the checkpoint"),
        "wrong_shape": (every, "'model.2.weight' has shape (5, 32) here, (6, 32) in the checkpoint"),
        "wrong_dtype": (every, "'model.0.weight' is torch.float64 here, torch.float32 in the checkpoint"),
    }
    if world > 1:
        expected["one_rank_file"] = (every, f"__{world - 1}_0.distcp is cut short")
        expected["one_rank_shape"] = ([world - 1], "'model.2.bias' has shape (1,) here, (6,)")
    for rank, r in enumerate(results):
        for name, (failed, why) in expected.items():
            got = r[name]
            assert got["error"] is not None and "nothing was loaded" in got["error"], (rank, name, got)
            assert got["unchanged"], (rank, name, got)  # parameters and optimizer state, bitwise
            assert got["failed"] == failed, (rank, name, got)
            if rank in failed:  # the failing rank says why; the others name it
                assert why in got["error"], (rank, name, got)
        assert not r["dcp_flipped_raises"], (rank, r)
        assert r["step_loaded"] == 7, (rank, r["step_loaded"])  # a top-level non-tensor value, as dcp.load
        assert r["good_equals_dcp"] and r["good_equals_saved"] and r["trains_on_equal"], (rank, r)
        assert r["unstaged_flipped"]["error"] is None, (rank, r)  # staged=False is dcp.load: no check


@pytest.mark.parametrize("world", [1, 2])
def test_a_damaged_or_mismatched_checkpoint_changes_nothing_on_any_rank(distributed, tmp_path, world: int) -> None:
    results = distributed(_rank, world, str(tmp_path))
    _check(results, world)
    assert any(r["dcp_flipped_wrong"] for r in results)  # what dcp.load alone does: a wrong value, silently


class _AppState:
    """The DCP recipe's application state, a ``Stateful``: a model, its optimizer and a step count
    behind one entry (``state_dict`` / ``load_state_dict`` through torch's state-dict helpers)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        self.model, self.opt, self.step = model, opt, step

    def state_dict(self) -> dict[str, Any]:
        return dict(_state_dict(self.model, self.opt), step=self.step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.step = state_dict["step"]


NOTE = "a non-tensor value of some size " * 64  # a torch.save record (BYTE_IO) long enough to damage


def _rank_stateful(rank: int, world: int, root: str) -> dict[str, Any]:
    """A ``Stateful`` entry and a non-tensor value, over a model whose shards are uneven on 2 ranks
    (5 rows: 3 and 2; 1 row: 1 and none): a bit flipped in the non-tensor value's record, then the
    good checkpoint."""
    import torch.distributed.checkpoint as dcp

    good = os.path.join(root, "good")
    saved_model, saved_opt = _trained(out_features=1, hidden=5)
    dcp.save({"app": _AppState(saved_model, saved_opt, step=7), "note": NOTE}, checkpoint_id=good)
    saved = _snapshot(saved_model, saved_opt)

    model, opt = _trained(out_features=1, hidden=5)
    _step(model, opt, seed=2)  # now differs from the checkpoint
    app = _AppState(model, opt, step=0)
    out: dict[str, Any] = {}
    flipped = _damaged_copy(good, os.path.join(root, "flipped_note"), lambda p: _flip_bit(p, "note"))
    target = {"app": app, "note": "old"}
    out["flipped_note"] = _attempt(lambda: overlap.load_checkpoint(target, checkpoint_id=flipped), model, opt)
    out["flipped_note"]["kept"] = (target["note"], app.step) == ("old", 0)
    overlap.load_checkpoint(target, checkpoint_id=good)
    out["good"] = {"equals_saved": _same(_snapshot(model, opt), saved), "step": app.step,
                   "note": target["note"] == NOTE}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_stateful_entries_uneven_shards_and_non_tensor_records(distributed, tmp_path, world: int) -> None:
    """As ``dcp.load``: a ``Stateful`` entry is loaded through its ``load_state_dict`` (tensors and
    non-tensor values alike) and a top-level non-tensor value is replaced; a model whose shards are
    uneven loads bitwise. A flipped bit in a non-tensor value's record (a ``torch.save`` record like a
    tensor's) fails its CRC32 on every rank, with nothing changed: parameters, optimizer state, the
    ``Stateful``'s step and the value."""
    for rank, r in enumerate(distributed(_rank_stateful, world, str(tmp_path))):
        got = r["flipped_note"]
        assert got["error"] is not None and "nothing was loaded" in got["error"], (rank, got)
        assert got["unchanged"] and got["kept"], (rank, got)
        assert got["failed"] == list(range(world)), (rank, got)
        assert "fails its CRC32 check" in got["error"], (rank, got)
        assert r["good"] == {"equals_saved": True, "step": 7, "note": True}, (rank, r["good"])
