"""Run a function on several ranks, each in its own process with a process group set up.

Contract of :func:`run_distributed`:

- ``fn(rank, world_size, *args, **kwargs)`` runs once per rank, in a fresh child process, between
  ``init_process_group`` and ``destroy_process_group``; the call returns the ranks' return values as
  a list indexed by rank. Results and arguments travel by plain ``pickle`` (tensors are copied, not
  shared), so they must be picklable and their types importable.
- ``fn`` is found in the child by module and qualified name, so it must be defined at module level.
  A test module that pytest imported by putting its folder on ``sys.path`` works (the child gets the
  parent's ``sys.path``); a module the child cannot import by name is loaded again from its file.
  As with any ``multiprocessing`` start method but fork, a script calling it needs the
  ``if __name__ == "__main__":`` guard.
- ``link=(gbps, latency_us)`` runs ``fn`` inside ``overlap.testing.emulated_link(gbps, latency_us)``
  on every rank; ``overlap.testing.current_link()`` returns that link (and its stats) inside ``fn``.
- If a rank raises, a :class:`DistributedTestError` names the rank and carries its formatted
  traceback (the earliest failure is the headline; failures of other ranks seen within a short grace
  period are listed too). A rank that dies without reporting (``os._exit``, a signal) is reported with
  its exit code; one killed by a signal also gets a hint (a rank aborted inside a collective usually
  means mismatched collectives: rerun with ``OVERLAP_DEBUG=1``). Every other rank is then killed.
- A rank that raises reports its error at once and exits without ``destroy_process_group``: see
  [Note: report before destroying the process group].
- Nothing runs past ``timeout`` seconds (plus a second or two of clean-up): the ranks still running
  are killed and a :class:`DistributedTimeoutError` (a ``TimeoutError``) names them, with the Python
  stacks they were stuck in.
- The process group's timeout is ``pg_timeout`` seconds (default: ``timeout``). A shorter one lets the
  ranks themselves notice a failed peer (their collectives time out) before the call does; with
  ``failure_grace`` (seconds, default 2) at least that long, their errors are collected too.
- Children see the parent's environment (``os.environ`` at call time, e.g. ``TRITON_INTERPRET=1``),
  working directory, ``sys.path``, stdout and stderr.

Process start-up. Ranks are forked from a ``multiprocessing`` fork server that has imported torch
and ``overlap`` once (a fresh interpreter, not a copy of the threaded caller, so it is as safe as
"spawn"). The first call in a process starts the server (~5 s on a 2-core box, not counted against
``timeout``); after that a trivial 2-rank run costs ~0.1 s, against ~5 s per call with "spawn".
Modules the caller's ``fn`` needs beyond those are imported by each rank; modules named in
``OVERLAP_TEST_FORKSERVER_PRELOAD`` (comma-separated; importable by a fresh interpreter, as Python 3.11's
fork server does not get the caller's ``sys.path``; one that is not is skipped) are imported by the
server too, after those, so that what they do at import (e.g. a one-time probe whose answer is cached in
memory) is inherited by every rank instead of repeated in each. Set
``OVERLAP_TEST_START_METHOD=spawn`` to use plain spawn. Under the fork server, environment variables
that torch reads while being imported come from the first call's environment, and so does
``TRITON_INTERPRET`` (importing ``overlap`` imports ``overlap_kernels``, whose Triton kernels are decorated
for the interpreter or not at import): a call that needs another value must use spawn.

Threads. Unless ``OMP_NUM_THREADS`` is set, each rank uses ``max(1, cpu_count // world_size)``
intra-op threads, so ranks sharing a small machine do not oversubscribe it.
"""
from __future__ import annotations

import datetime
import faulthandler
import importlib
import importlib.util
import inspect
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from overlap.testing.emulated_link import EmulatedLink
from overlap.testing.emulated_link.timing import check_number

__all__ = ["DistributedTestError", "DistributedTimeoutError", "RankFailure", "run_distributed"]

_START_METHOD_ENV = "OVERLAP_TEST_START_METHOD"
# The server imports this module (so ``overlap``, Triton and torch's distributed and Inductor
# modules) once: every rank's target, ``_child_main``, lives here, and importing ``overlap`` in each
# rank instead costs seconds per call.
_PRELOAD = ["torch", "torch.distributed", __name__]
_EXTRA_PRELOAD_ENV = "OVERLAP_TEST_FORKSERVER_PRELOAD"
# After the first failure, how long to keep collecting other ranks' reports before killing them.
_FAILURE_GRACE_S = 2.0
# How long a terminated rank gets before SIGKILL, and how long a hung rank gets to dump its stacks.
_TERMINATE_GRACE_S = 0.5
_STACK_DUMP_WAIT_S = 0.3
_BACKENDS = ("gloo", "nccl")

# [Note: report before destroying the process group]
# A rank whose ``fn`` raised used to call ``destroy_process_group`` first and report afterwards. With
# a collective of its own still in flight (issued, never matched by a peer that is now blocked
# elsewhere), gloo's destructor waits for that work, so the rank never reported: both ranks sat idle
# until the process group's timeout and the caller saw a timeout with no error, or the peer's data
# reached the pending work (a size mismatch: gloo's EnforceNotMet aborted the rank, SIGABRT) and the
# only error left was the peer's "Connection reset by peer". Both hid the first rank's exception. So
# a failed rank now reports first, with the time it failed, and exits without destroying the group;
# the closed connections make the other ranks fail fast, and the caller kills what is left. Failures
# are ordered by that time, peers' reports of a closed connection last: the headline is the cause,
# not whichever report arrived first.

# [Note: connected before fn]
# ``init_process_group`` can return on one rank before gloo has connected every pair (seen on torch
# 2.15): a rank whose ``fn`` returned at once then exited, and a peer still connecting failed with
# "Connection closed by peer" in its own ``init_process_group``, hiding its real result (an exception
# the caller expected). A barrier right after the initialization makes every rank connected first.


_SIGNAL_HINT = (
    "A rank killed by a signal while others wait in a collective (e.g. SIGABRT from gloo's "
    "EnforceNotMet, 'Received data size doesn't match expected size') usually means the ranks issued "
    "different collectives, or collectives of one group from two threads at once: rerun with "
    "OVERLAP_DEBUG=1 to get an overlap.DesyncError naming the collective each rank issued."
)


# What a rank raises when a peer's connection closes (gloo's words, and overlap's CollectiveError).
_PEER_SYMPTOMS = ("Connection reset by peer", "Connection closed by peer", "a rank of the group failed or died")


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: with a Python exception (``traceback`` set) or by dying (``exitcode``).

    ``at`` is when it failed (``time.monotonic()``, system-wide on Linux): the rank's own clock when it
    raised, or the caller's when it saw the rank die.
    """

    rank: int
    traceback: str | None
    exitcode: int | None
    exception: BaseException | None = None
    at: float = 0.0

    @property
    def peer_symptom(self) -> bool:
        """The rank raised because a peer went away (its connection closed): a consequence of another
        rank's failure, listed after the failures that caused it."""
        return self.traceback is not None and any(text in self.traceback for text in _PEER_SYMPTOMS)

    def describe(self) -> str:
        if self.traceback is not None:
            return f"rank {self.rank} raised:\n{self.traceback.rstrip()}"
        if self.exitcode is not None and self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return (f"rank {self.rank} was killed by {name} (exit code {self.exitcode}) without reporting a "
                    f"result. {_SIGNAL_HINT}")
        return f"rank {self.rank} exited with code {self.exitcode} without reporting a result"


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` failed.

    ``rank`` / ``traceback`` / ``exitcode`` describe the first failure (the earliest one that is not a
    rank's report of a peer's closed connection, when there is one); ``failures`` maps every rank
    seen failing to its :class:`RankFailure`. ``__cause__`` is the first rank's exception when it
    could be pickled back.
    """

    def __init__(self, failures: Sequence[RankFailure], world_size: int) -> None:
        first = failures[0]
        self.failures: dict[int, RankFailure] = {f.rank: f for f in failures}
        self.rank: int = first.rank
        self.traceback: str | None = first.traceback
        self.exitcode: int | None = first.exitcode
        parts = [f"rank {first.rank} of {world_size} failed first; " + first.describe()]
        parts += ["also: " + f.describe() for f in failures[1:]]
        super().__init__("\n".join(parts))


class DistributedTimeoutError(TimeoutError):
    """:func:`run_distributed` ran past its timeout; ``ranks`` lists the ranks that had not finished."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class _FnRef:
    """A module-level function, named so that a child process can import it."""

    module: str
    qualname: str
    file: str | None


def _fn_payload(fn: Callable[..., Any]) -> _FnRef | bytes:
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if isinstance(qualname, str) and isinstance(module, str) and hasattr(fn, "__code__"):
        if "<" in qualname:  # <locals>, <lambda>
            raise ValueError(
                f"fn must be a module-level function so the spawned ranks can import it; "
                f"got {module}.{qualname}"
            )
        file = getattr(sys.modules.get(module), "__file__", None)
        return _FnRef(module, qualname, file)
    try:
        return pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"fn must be a module-level function or a picklable callable; got {fn!r}: {e}") from e


def _resolve_fn(payload: _FnRef | bytes) -> Callable[..., Any]:
    if isinstance(payload, bytes):
        return pickle.loads(payload)
    try:
        module = importlib.import_module(payload.module)
    except ImportError:
        if payload.file is None:
            raise
        spec = importlib.util.spec_from_file_location(payload.module, payload.file)
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        sys.modules[payload.module] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in payload.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child_main(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    pg_timeout: float,
    fn_payload: _FnRef | bytes,
    call_payload: bytes,
    link: tuple[float, float] | None,
    env: dict[str, str],
    stdout_fd: Any,
    stderr_fd: Any,
    stack_file: str,
    conn: multiprocessing.connection.Connection,
) -> None:
    # Output goes where the caller's goes now (matters under a fork server and pytest's fd capture).
    for passed, target in ((stdout_fd, 1), (stderr_fd, 2)):
        fd = passed.detach() if hasattr(passed, "detach") else passed
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    faulthandler.enable()
    stack_out = open(stack_file, "w")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        if "OMP_NUM_THREADS" not in env:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        fn = _resolve_fn(fn_payload)
        args, kwargs = pickle.loads(call_payload)
        init_kwargs: dict[str, Any] = {}
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            if "device_id" in inspect.signature(dist.init_process_group).parameters:
                init_kwargs["device_id"] = device
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
            **init_kwargs,
        )
        # Every rank connected before any runs ``fn`` ([Note: connected before fn]).
        dist.barrier(**({"device_ids": [torch.cuda.current_device()]} if backend == "nccl" else {}))
        if link is None:
            result = fn(rank, world_size, *args, **kwargs)
        else:
            with EmulatedLink(*link):
                result = fn(rank, world_size, *args, **kwargs)
        dist.destroy_process_group()  # only after success: [Note: report before destroying the process group]
        message = pickle.dumps(("ok", result))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which re-raises)
        failed_at = time.monotonic()
        tb = traceback.format_exc()
        try:
            exc_bytes: bytes | None = pickle.dumps(e)
        except Exception:
            exc_bytes = None
        message = pickle.dumps(("error", tb, exc_bytes, failed_at))
    try:
        conn.send_bytes(message)
    except Exception:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), None, time.monotonic())))
    conn.close()


_EOF = object()


def _receive(conn: multiprocessing.connection.Connection) -> Any:
    """A rank's report if one is ready, ``_EOF`` if its pipe is closed, else None."""
    try:
        if not conn.poll():
            return None
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        return _EOF


def _unpickle_or_none(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:
        return None


_BAD_FORK_EXIT = 3
"""The warm-up rank's exit code when it was forked from a server that had initialized CUDA."""
_NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _warm_up() -> None:
    """The fork server's first child: exits with ``_BAD_FORK_EXIT`` if CUDA cannot be used in a rank
    forked from this server (the server initialized CUDA while importing its preload modules)."""
    import torch

    if torch.cuda._is_in_bad_fork():
        sys.exit(_BAD_FORK_EXIT)


def _cuda_device_visible() -> bool:
    """Can this process see a CUDA device (``torch.cuda.is_available()``)? Then a CUDA-poisoned fork
    server hands ranks that fail their first CUDA call."""
    import torch

    return torch.cuda.is_available()


_server_ready = False
_method_fallback: str | None = None
"""``"spawn"`` once the fork server turned out to hand CUDA-poisoned ranks (see :func:`_context`)."""


def _context() -> multiprocessing.context.BaseContext:
    """The start method's context; a fork server is started (torch imported) before the first use,
    so its one-time start-up (seconds) does not count against a call's timeout."""
    global _server_ready, _method_fallback
    method = os.environ.get(_START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{_START_METHOD_ENV} must be 'forkserver' or 'spawn', got {method!r}")
    if method == "forkserver" and _method_fallback is not None:
        method = _method_fallback
    ctx = multiprocessing.get_context(method)
    if method == "forkserver" and not _server_ready:
        # A preload module may ask torch.cuda.is_available() (Inductor's import of cpp_extension does
        # where a CUDA toolkit is installed); answered by the CUDA runtime, that initializes CUDA in
        # the server, and every rank forked from it fails its first CUDA call (Dynamo and the
        # optimizers make one whenever CUDA is available). NVML answers without initializing.
        os.environ.setdefault(_NVML_CHECK_ENV, "1")
        extra = [name.strip() for name in os.environ.get(_EXTRA_PRELOAD_ENV, "").split(",") if name.strip()]
        ctx.set_forkserver_preload(_PRELOAD + extra)
        warm_up = ctx.Process(target=_warm_up, name="forkserver-warm-up")
        warm_up.start()
        warm_up.join()
        _server_ready = True
        # A CUDA build of torch on a machine without a GPU poisons forks too (NVML is absent, so the
        # check falls back to the CUDA runtime), but its ranks never use CUDA: keep the fork server
        # there (spawned ranks are slower and miss the server's preloaded ISA pick).
        if warm_up.exitcode == _BAD_FORK_EXIT and _cuda_device_visible():
            import warnings

            warnings.warn("run_distributed: the ranks' fork server initialized CUDA while importing its preload "
                          f"modules ({', '.join(_PRELOAD + extra)}; {_NVML_CHECK_ENV}="
                          f"{os.environ.get(_NVML_CHECK_ENV)!r}), so ranks forked from it could not use CUDA: "
                          "ranks are started with 'spawn' from now on (seconds per call)", RuntimeWarning,
                          stacklevel=3)
            _method_fallback = "spawn"
            ctx = multiprocessing.get_context("spawn")
    return ctx


def _stop(procs: dict[int, multiprocessing.process.BaseProcess]) -> None:
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _check_arguments(fn: object, world_size: object, backend: object, timeout: object, link: object,
                     pg_timeout: object, failure_grace: object) -> None:
    """:func:`run_distributed`'s argument checks, in the caller, before any rank starts."""
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be a module-level function taking (rank, world_size, ...), "
                        f"got {type(fn).__name__} {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"run_distributed: world_size must be an int >= 1, got {type(world_size).__name__} "
                        f"{world_size!r}")
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"run_distributed: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            raise ValueError(f"run_distributed: backend='nccl' puts each rank on a GPU of its own and needs "
                             f"world_size <= the GPUs visible ({gpus}), got world_size={world_size}; use "
                             f"backend='gloo' on CPU")
    check_number(timeout, "run_distributed: timeout must be a finite number of seconds > 0", positive=True)
    if pg_timeout is not None:
        check_number(pg_timeout, "run_distributed: pg_timeout must be None (= timeout) or a finite number of "
                     "seconds > 0", positive=True)
    check_number(failure_grace, "run_distributed: failure_grace must be a finite number of seconds >= 0",
                 positive=False)
    if link is not None:
        if not isinstance(link, tuple) or len(link) != 2:
            raise ValueError(f"run_distributed: link must be None or a (gbps, latency_us) tuple, got {link!r}")
        try:
            EmulatedLink(*link)  # checks the values here rather than in every rank
        except (TypeError, ValueError) as e:
            raise type(e)(f"run_distributed: link=(gbps, latency_us): {e}") from None


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    link: tuple[float, float] | None = None,
    pg_timeout: float | None = None,
    failure_grace: float = _FAILURE_GRACE_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results by rank.

    ``backend`` is the ``torch.distributed`` backend ("gloo" on CPU; "nccl" puts rank ``r`` on GPU
    ``r`` and needs ``world_size`` GPUs). ``timeout`` (seconds) bounds the whole call; ``pg_timeout``
    (seconds, default ``timeout``) is the process group's timeout. After the first rank fails, the
    others get ``failure_grace`` seconds to report before they are killed. ``link=(gbps, latency_us)`` runs
    ``fn`` inside :func:`overlap.testing.emulated_link` on every rank (``current_link()`` returns it
    there).
    Raises :class:`DistributedTestError` if a rank fails, :class:`DistributedTimeoutError` on timeout,
    and ``TypeError`` / ``ValueError`` naming the argument (before any rank starts) for bad arguments.
    """
    _check_arguments(fn, world_size, backend, timeout, link, pg_timeout, failure_grace)
    fn_payload = _fn_payload(fn)
    try:
        call_payload = pickle.dumps((args, kwargs))
    except Exception as e:
        raise TypeError(f"run_distributed: the extra args and kwargs for fn must be picklable (they travel to "
                        f"the ranks by pickle): {e}") from e
    ctx = _context()
    deadline = time.monotonic() + timeout
    tmpdir = tempfile.mkdtemp(prefix="overlap-dist-")
    init_method = "file://" + os.path.join(tmpdir, "store")
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    conns: dict[int, multiprocessing.connection.Connection] = {}
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    try:
        env = dict(os.environ)
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child_main,
                name=f"rank{rank}",
                args=(
                    rank, world_size, backend, init_method, pg_timeout or timeout, fn_payload, call_payload,
                    link, env, multiprocessing.reduction.DupFd(1),
                    multiprocessing.reduction.DupFd(2),
                    os.path.join(tmpdir, f"stacks{rank}.txt"), writer,
                ),
            )
            p.start()
            writer.close()
            procs[rank] = p
            conns[rank] = reader
        failure_deadline: float | None = None
        pending = set(range(world_size))
        listening = set(range(world_size))  # ranks whose pipe has not reached EOF
        while pending:
            stop_at = deadline if failure_deadline is None else min(deadline, failure_deadline)
            now = time.monotonic()
            if now >= stop_at:
                break
            waitables: list[Any] = [conns[r] for r in pending & listening]
            waitables += [procs[r].sentinel for r in pending]
            ready = set(multiprocessing.connection.wait(waitables, timeout=stop_at - now))
            for rank in sorted(pending):
                conn, proc = conns[rank], procs[rank]
                if rank in listening and (conn in ready or proc.sentinel in ready):
                    message = _receive(conn)
                    if message is _EOF or (message is None and proc.sentinel in ready):
                        listening.discard(rank)
                    elif message is not None:
                        pending.discard(rank)
                        if message[0] == "ok":
                            results[rank] = message[1]
                        else:
                            exc = _unpickle_or_none(message[2])
                            failures.append(RankFailure(rank, message[1], None, exc, message[3]))
                        continue
                if proc.sentinel in ready and rank not in listening:
                    proc.join()
                    pending.discard(rank)
                    failures.append(RankFailure(rank, None, proc.exitcode, at=time.monotonic()))
            if failures and failure_deadline is None:
                failure_deadline = time.monotonic() + failure_grace
        if failures:
            # The earliest cause first (whichever report came first), peers' "connection closed" after it.
            failures.sort(key=lambda f: (f.peer_symptom, f.at))
            err = DistributedTestError(failures, world_size)
            raise err from failures[0].exception
        if pending:
            stuck = sorted(pending)
            for rank in stuck:
                if procs[rank].pid is not None and procs[rank].is_alive():
                    os.kill(procs[rank].pid, signal.SIGUSR1)
            time.sleep(_STACK_DUMP_WAIT_S)
            stacks = []
            for rank in stuck:
                try:
                    with open(os.path.join(tmpdir, f"stacks{rank}.txt")) as f:
                        text = f.read().strip()
                except OSError:
                    text = ""
                if text:
                    stacks.append(f"--- rank {rank} stacks ---\n{text}")
            finished = sorted(set(range(world_size)) - pending)
            message = (
                f"run_distributed({getattr(fn, '__qualname__', fn)!r}, world_size={world_size}) timed "
                f"out after {timeout} s: ranks {stuck} had not finished (finished: {finished})"
            )
            raise DistributedTimeoutError("\n".join([message, *stacks]), stuck)
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for conn in conns.values():
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
