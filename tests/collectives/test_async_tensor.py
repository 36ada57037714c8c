"""AsyncTensor: every way of consuming a pending result waits first, exactly once.

A ``Completion`` that writes the result only when waited makes a missed wait visible: the consumer
would read the placeholder zeros instead of the final values.
"""
from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch

from scheduler import AsyncTensor, is_pending, wait_tensor
from scheduler.async_tensor import set_observer

FINAL = torch.arange(1.0, 13.0).view(3, 4)


class _FillOnWait:
    """Writes FINAL into the buffer only when waited; counts the waits."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.waits = buffer, 0

    def wait(self) -> None:
        self.waits += 1
        self.buffer.copy_(FINAL)


def _pending():
    buffer = torch.zeros(3, 4)
    completion = _FillOnWait(buffer)
    return AsyncTensor.wrap(buffer, completion), completion


CONSUMERS = {
    "add": lambda t: t + 1,
    "matmul": lambda t: t @ torch.ones(4, 2),
    "view_then_use": lambda t: t.view(12) * 1,
    "reshape": lambda t: t.reshape(4, 3) + 0,
    "slice": lambda t: t[1:, ::2] + 0,
    "transpose": lambda t: t.t().contiguous(),
    "chunk": lambda t: torch.cat([c + 0 for c in t.chunk(2, dim=1)], dim=1),
    "inplace": lambda t: t.mul_(2).div_(2),
    "item": lambda t: torch.tensor(t[2, 3].item()),
    "tolist": lambda t: torch.tensor(t.tolist()),
    "numpy": lambda t: torch.from_numpy(t.numpy().copy()),
    "cat_with_plain": lambda t: torch.cat([torch.zeros(1, 4), t])[1:],
    "copy_into": lambda t: torch.empty(3, 4).copy_(t),
    # Passed by keyword, as an input and as the output an op writes into (a write that did not wait
    # would be overwritten by the collective's late result).
    "keyword_input": lambda t: torch.mul(torch.full((3, 4), 2.0), other=t),
    "keyword_weight": lambda t: torch.nn.functional.linear(torch.ones(2, 4), weight=t),
    "keyword_out": lambda t: (torch.add(torch.ones(3, 4), 1, out=t), t)[1] * 1,
    "module_call": lambda t: torch.nn.functional.linear(t, torch.eye(4)),
    "sum": lambda t: t.sum().expand(1) * 0 + t.sum(),
    "clone": lambda t: t.clone(),
    "data_ptr": lambda t: (t.data_ptr(), t)[1] + 0,
    # DLPack: the protocol method goes through __torch_function__; the legacy C function does not and
    # is patched by scheduler.async_tensor (see [Note: DLPack export]).
    "from_dlpack": lambda t: torch.from_dlpack(t).clone(),
    "utils_to_dlpack": lambda t: torch.from_dlpack(torch.utils.dlpack.to_dlpack(t)).clone(),
    "torch_to_dlpack": lambda t: torch.from_dlpack(torch.to_dlpack(t)).clone(),
}


@pytest.mark.parametrize("name", sorted(CONSUMERS))
def test_every_consumer_waits_exactly_once(name: str) -> None:
    t, completion = _pending()
    assert is_pending(t) and completion.waits == 0
    out = CONSUMERS[name](t)
    assert completion.waits == 1
    expected = CONSUMERS[name](FINAL.clone())
    assert torch.equal(torch.as_tensor(out).float(), torch.as_tensor(expected).float())
    assert type(t) is torch.Tensor and not is_pending(t)
    CONSUMERS[name](t)
    assert completion.waits == 1, "a second use must not wait again"


def test_print_and_repr_show_completed_data() -> None:
    t, completion = _pending()
    buf = io.StringIO()
    with redirect_stdout(buf):
        print(t)
    assert completion.waits == 1
    assert "12." in buf.getvalue() and "AsyncTensor" not in buf.getvalue()


def test_metadata_does_not_wait() -> None:
    t, completion = _pending()
    assert t.shape == (3, 4) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.dim() == 2 and t.numel() == 12 and t.size(0) == 3 and t.stride() == (4, 1)
    assert t.is_contiguous() and not t.requires_grad and len(t) == 3
    {t: 1}  # hashing (dict keys in a runtime) must not wait either
    t.requires_grad = False  # neither does setting metadata (a runtime marking a gathered parameter)
    t.grad = None
    assert completion.waits == 0 and is_pending(t)


def test_autograd_through_a_pending_result() -> None:
    w = torch.ones(4, 2, requires_grad=True)
    t, completion = _pending()
    (t @ w).sum().backward()
    assert completion.waits == 1
    assert torch.equal(w.grad, FINAL.sum(0, keepdim=True).t().expand(4, 2))


def test_wait_tensor_is_idempotent_and_handles_containers() -> None:
    a, ca = _pending()
    b, cb = _pending()
    assert wait_tensor({"a": a, "rest": [b, 3]})["a"] is a
    wait_tensor([a, b])
    assert (ca.waits, cb.waits) == (1, 1)
    assert torch.equal(a, FINAL) and torch.equal(b, FINAL)


def test_failed_wait_leaves_the_tensor_pending() -> None:
    class _Fails:
        calls = 0

        def wait(self) -> None:
            _Fails.calls += 1
            if _Fails.calls == 1:
                raise TimeoutError("collective timed out")

    t = AsyncTensor.wrap(torch.zeros(2), _Fails())
    with pytest.raises(TimeoutError):
        t + 1
    assert is_pending(t), "after a failed wait a later use must not read unfinished data"
    t + 1
    assert _Fails.calls == 2 and not is_pending(t)


def test_a_wait_refused_by_the_observer_leaves_the_tensor_pending() -> None:
    """``WaitObserver.on_wait`` may raise (the scheduler's verify mode does): the tensor then keeps its
    completion, so a later use still waits, once, and reads the final data, not the placeholder."""

    class _Refuses:
        def on_issue(self, pending: AsyncTensor, kind: str, group: str) -> None:
            pass

        def on_wait(self, pending: AsyncTensor, func: object) -> None:
            raise RuntimeError("first used somewhere else")

    t, completion = _pending()
    previous = set_observer(_Refuses())
    try:
        with pytest.raises(RuntimeError, match="somewhere else"):
            t + 1
    finally:
        set_observer(previous)
    assert is_pending(t) and completion.waits == 0
    assert torch.equal(t + 1, FINAL + 1) and completion.waits == 1
    assert not is_pending(t)


def test_op_after_wait_is_a_plain_tensor_op() -> None:
    t, _ = _pending()
    wait_tensor(t)
    assert type(t) is torch.Tensor
    assert type(t + 1) is torch.Tensor and type(t.view(-1)) is torch.Tensor


def test_dlpack_patch_keeps_torch_behaviour_for_plain_tensors() -> None:
    plain = torch.arange(6.0)
    for export in (torch.utils.dlpack.to_dlpack, torch.to_dlpack):
        shared = torch.from_dlpack(export(plain))
        assert shared.data_ptr() == plain.data_ptr() and torch.equal(shared, plain), "the capsule shares memory"
    with pytest.raises(TypeError):
        torch.utils.dlpack.to_dlpack("not a tensor")  # torch's own error, unchanged


@pytest.mark.skipif(not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
                    reason="this torch has no DLPack C exchange API")
def test_dlpack_c_exchange_api_is_hidden_until_the_wait() -> None:
    """A consumer of DLPack's C exchange API looks it up on the type and would export without calling
    Python; on a pending tensor the lookup fails, so it falls back to ``__dlpack__``, which waits."""
    t, completion = _pending()
    assert not hasattr(type(t), "__dlpack_c_exchange_api__") and not hasattr(t, "__dlpack_c_exchange_api__")
    assert completion.waits == 0, "looking it up does not wait"
    wait_tensor(t)
    assert type(t).__dlpack_c_exchange_api__ is torch.Tensor.__dlpack_c_exchange_api__
