"""DCP loads that cannot match the checkpoint fail with torch's own error and change nothing.

A sharded model is saved with ``dcp.save``; loading into a state dict with a key the checkpoint
lacks, or with a parameter of another shape, must raise (DCP's ``CheckpointException``, naming the
key) before any parameter of the model is written.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import overlap


def _model(out_features: int = 5) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out_features))
    overlap.shard(model[0])
    overlap.shard(model)
    return model


def _local_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _attempt(load: Any, model: nn.Module) -> dict[str, Any]:
    before = _local_copy(model)
    try:
        load()
        error = None
    except BaseException as e:  # noqa: BLE001 -- DCP's CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"
    after = _local_copy(model)
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def _rank(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    saved = _model()
    dcp.save(saved.state_dict(), checkpoint_id=path)

    target = _model()
    with torch.no_grad():
        for p in target.parameters():
            p.to_local().fill_(7.0)
    extra = dict(target.state_dict(), **{"2.scale": torch.zeros(3)})
    missing_key = _attempt(lambda: dcp.load(extra, checkpoint_id=path), target)

    other_shape = _model(out_features=3)
    with torch.no_grad():
        for p in other_shape.parameters():
            p.to_local().fill_(7.0)
    wrong_shape = _attempt(lambda: dcp.load(other_shape.state_dict(), checkpoint_id=path), other_shape)

    ok = _attempt(lambda: dcp.load(target.state_dict(), checkpoint_id=path), target)
    equal = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(target.parameters(), saved.parameters()))
    return {"missing_key": missing_key, "wrong_shape": wrong_shape, "ok": ok, "equal_after_good_load": equal}


def test_dcp_load_with_a_missing_or_misshaped_key_raises_and_changes_nothing(distributed, tmp_path) -> None:
    for r in distributed(_rank, 2, str(tmp_path / "ckpt")):
        assert r["missing_key"]["error"] is not None and "2.scale" in r["missing_key"]["error"], r
        assert r["missing_key"]["unchanged"], r
        assert r["wrong_shape"]["error"] is not None and "Size mismatch" in r["wrong_shape"]["error"], r
        assert r["wrong_shape"]["unchanged"], r
        assert r["ok"]["error"] is None and r["equal_after_good_load"], r  # the same load, matching: works
