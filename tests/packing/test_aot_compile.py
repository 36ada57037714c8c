"""Ahead-of-time compiles of the four packing kernels (and tensor parallelism's two chunk kernels,
``test_aot_compile_chunk_kernels``, and the three quantized kernels, ``test_aot_compile_quantized_kernels``)
for sm_80 and sm_90, on a CPU-only machine.

Select with ``pytest -k aot_compile``. Each kernel is compiled the way a GPU launch compiles it: the
op's own launcher builds the call (``_kernel_call``: tables, arguments, constexprs such as ``VEC``,
``COMPUTE``, ``HAS_SCALE``), ``_launch._pick_block`` gives the CUDA block configuration, and Triton's
own argument binder specializes the arguments (types, 16-byte divisibility) before
``triton.compile`` runs with Triton's bundled ptxas for ``GPUTarget("cuda", 80, 32)`` and
``GPUTarget("cuda", 90, 32)``. One subprocess compiles everything (``TRITON_INTERPRET`` unset, so
``triton.jit`` makes real JIT functions; a fresh Triton cache, so ptxas runs and reports).

Matrix: fp32/bf16/fp16 in and out (9 pairs) for every kernel; reduce_scatter_copy_in with and
without a scale; reduce_scatter_copy_out copying, scaling, accumulating, both; all parameters of
one dtype (one dtype group). Besides, per kernel, one launch whose parameters mix fp32, bf16 and
fp16 (three dtype groups, a branch each). The largest run is 4000 elements, so the kernels get the
GPU's largest block: ``BLOCK=4096``, 8 warps, scalar steps of 1024 elements.

Checked per compile:

* **Registers**: at most ``REGISTER_BUDGET`` = 40 per thread (ptxas ``-v``), 48 with three dtype
  groups (``MIXED_REGISTER_BUDGET``), and no spills (0 bytes of spill stores/loads, 0-byte stack
  frame). 40 registers x 256 threads lets 6 blocks (48 of 64 warps) share an SM's 64K registers on
  sm_80 and sm_90; 48 lets 5 (40 warps).
* **No shared memory** (``metadata.shared == 0``): no layout conversion between the load and the
  store side ([Note: per-thread width] in ``overlap_kernels._jit``).
* **Vector accesses**: on the aligned unmasked path each thread stores its 16 elements with 128-bit
  ``st.global.v4.b32`` and loads them with ``ld.global.v4.b32``, except that a source half as wide
  as the destination (16-bit to fp32) is loaded with 64-bit ``ld.global.v2.b32`` (4 elements per
  thread on both sides); exact counts, and no other vector width. Everything else (tables, the
  unaligned and masked paths) is scalar. (Mixed-dtype launches: 128-bit stores of the widest
  destination dtype, no exact counts.)

Toolchain and driver: with triton 3.9's wheel (torch 2.15), sm_80 code comes from its ptxas 12.9
(PTX ISA 8.8) and sm_90 code (``sm_90a``) from its ``ptxas-blackwell`` 13.4 (PTX ISA 9.4); with
triton 3.8's (torch 2.14) both come from ptxas 12.9 (PTX ISA 8.8), with 3.6's (torch 2.11) and
3.7's (torch 2.12) from ptxas 12.8 (PTX ISA 8.7). Triton loads the cubin, so the driver must support the CUDA major version
of the ptxas that built it: a CUDA 12 driver (R525 or newer, minor-version compatibility) for A100,
and for H100 a CUDA 12 driver with Triton 3.6, 3.7 or 3.8 but a CUDA 13 driver (R580 or newer) with
Triton 3.9. On an older H100 driver, point
``TRITON_PTXAS_BLACKWELL_PATH`` at a CUDA 12.x ptxas. ``test_aot_compile_toolchain`` pins these
versions per Triton release, so a Triton upgrade that changes them fails there (a release not
recorded skips with its version) and the statement gets revisited.
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REGISTER_BUDGET = 40
"""Registers per thread, at most, with one dtype group (see the module docstring)."""
MIXED_REGISTER_BUDGET = 48
"""Registers per thread, at most, with three dtype groups."""

TOOLCHAIN = {
    (3, 6): {80: ("sm_80", "8.7", "12.8"), 90: ("sm_90a", "8.7", "12.8")},
    (3, 7): {80: ("sm_80", "8.7", "12.8"), 90: ("sm_90a", "8.7", "12.8")},
    (3, 8): {80: ("sm_80", "8.8", "12.9"), 90: ("sm_90a", "8.8", "12.9")},
    (3, 9): {80: ("sm_80", "8.8", "12.9"), 90: ("sm_90a", "9.4", "13.4")},
}
"""Triton (major, minor) -> target arch -> (PTX ``.target``, PTX ``.version``, ptxas release) of the
ptxas bundled in that Triton's wheel: the two ends of the supported range, torch 2.12's 3.7 and
torch 2.14's 3.8."""

TARGETS = (80, 90)
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}  # name -> bytes
MIXED = ("fp32", "bf16", "fp16")  # "mixed": the parameters' dtypes, cycled
MODES = {
    "all_gather_copy_in": ("copy",),
    "all_gather_copy_out": ("copy",),
    "reduce_scatter_copy_in": ("copy", "scale"),
    "reduce_scatter_copy_out": ("copy", "scale", "accumulate", "scale+accumulate"),
}
FLAT_IS_DESTINATION = {"all_gather_copy_in": True, "reduce_scatter_copy_in": True,
                       "all_gather_copy_out": False, "reduce_scatter_copy_out": False}
SHAPES, WORLD_SIZE, RANK = [(8000,), (30, 7), (4000, 1)], 2, 1  # largest run: 4000 elements
BLOCK, NUM_WARPS, CHUNK = 4096, 8, 1024
ELEMENTS_PER_THREAD = BLOCK // (32 * NUM_WARPS)
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    src: str  # dtype read
    dst: str  # dtype written
    mode: str

    @property
    def id(self) -> str:
        return f"{self.op}-{self.src}-{self.dst}-{self.mode}"

    @property
    def mixed(self) -> bool:
        return "mixed" in (self.src, self.dst)

    @property
    def widest_dst(self) -> int:
        return max(DTYPES[d] for d in (MIXED if self.dst == "mixed" else (self.dst,)))


CASES = [Case(op, s, d, m) for op, modes in MODES.items() for s in DTYPES for d in DTYPES for m in modes]
MIXED_CASES = [  # the parameter side mixes dtypes
    Case("all_gather_copy_in", "mixed", "bf16", "copy"),
    Case("all_gather_copy_out", "bf16", "mixed", "copy"),
    Case("reduce_scatter_copy_in", "mixed", "fp32", "scale"),
    Case("reduce_scatter_copy_out", "fp32", "mixed", "scale+accumulate"),
]


# --------------------------------------------------------------------- the compiling subprocess
def _kernel_call(case: Case) -> object:
    """The op's launcher's call for ``case`` on CPU tensors, with the CUDA block configuration."""
    import importlib

    import torch

    from overlap_kernels import ShardLayout, _launch

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    def dtype(name: str, i: int) -> torch.dtype:  # of parameter i ("mixed": cycled)
        return torch_dtypes[MIXED[i % len(MIXED)] if name == "mixed" else name]

    layout = ShardLayout(SHAPES, WORLD_SIZE)
    module = importlib.import_module(f"overlap_kernels.{case.op}")
    scale = 0.5 if "scale" in case.mode else None
    fulls = [torch.zeros(s, dtype=dtype(case.src, i)) for i, s in enumerate(layout.shapes)]
    if case.op == "all_gather_copy_in":
        slot = torch.empty(layout.buffer_numel, dtype=dtype(case.dst, 0)).view(WORLD_SIZE, -1)[RANK]
        call = module._kernel_call(layout.shards(fulls, RANK), layout, RANK, slot)
    elif case.op == "all_gather_copy_out":
        outs = [torch.empty(s, dtype=dtype(case.dst, i)) for i, s in enumerate(layout.shapes)]
        call = module._kernel_call(torch.zeros(layout.buffer_numel, dtype=dtype(case.src, 0)), layout, outs)
    elif case.op == "reduce_scatter_copy_in":
        call = module._kernel_call(fulls, layout, scale, torch.empty(layout.buffer_numel, dtype=dtype(case.dst, 0)))
    else:
        grads = [torch.zeros(s, dtype=dtype(case.dst, i)) for i, s in enumerate(layout.shard_shapes(RANK))]
        call = module._kernel_call(torch.zeros(layout.slot_numel, dtype=dtype(case.src, 0)), grads, layout, RANK,
                                   scale, "accumulate" in case.mode)
    # The tables were built for CPU tensors; a CUDA device gets this block configuration.
    max_run = max(int(layout.segments(r)[:, 4].max()) for r in (None, RANK))
    block, num_warps, chunk = _launch._pick_block(max_run, torch.device("cuda"))
    blocks = dataclasses.replace(call.blocks, block=block, num_warps=num_warps, chunk=chunk)
    return dataclasses.replace(call, blocks=blocks)


def _compile(call: object, arch: int) -> dict:
    """Compile ``call`` as ``kernel[grid](*args, **kwargs)`` would on a GPU of ``arch``; report."""
    import contextlib
    import io

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = call.kernel
    args, kwargs = call.arguments()
    # what JITFunction.run adds before binding (fpsan_homomorphic_casts is new in Triton 3.9)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # knobs.nvidia.dump_ptxas_log prints ptxas -v
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    ptxas = log.getvalue()
    ptx = compiled.asm["ptx"]
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    registers = re.search(r"Used (\d+) registers", ptxas)
    if spills is None or registers is None:
        raise RuntimeError(f"no ptxas -v report for {kernel.__name__} on sm_{arch}:\n{ptxas}")
    names = kernel.arg_names
    return {
        "signature": signature,
        "divisible16": sorted(names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v),
        "constexprs": {names[k[0]]: str(v) for k, v in constexprs.items()},
        "num_warps": options.num_warps,
        "enable_fp_fusion": options.enable_fp_fusion,
        "shared": compiled.metadata.shared,
        "registers": int(registers.group(1)),
        "stack": int(spills.group(1)),
        "spill_stores": int(spills.group(2)),
        "spill_loads": int(spills.group(3)),
        "accesses": dict(Counter(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)+", ptx))),
        "fma": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        "fp8_conversions": len(re.findall(r"e4m3|e5m2", ptx)),
        "packed_16bit_integer_ops": PACKED_16BIT_INTEGER.findall(ptx),
        "ptx_version": re.search(r"^\.version (\S+)", ptx, re.M).group(1),
        "ptx_target": re.search(r"^\.target (\S+)", ptx, re.M).group(1),
        "ptxas_release": re.search(r"release (\d+\.\d+)", _ptxas_version(arch)).group(1),
    }


TP_CASES = [("chunk_place", dt, "copy") for dt in DTYPES] + [
    ("chunk_pack", dt, mode) for dt in DTYPES for mode in ("copy", "scale+bias")]
"""Tensor parallelism's chunk kernels (``overlap_kernels.chunk_place`` / ``overlap_kernels.chunk_pack``): op, dtype,
epilogue."""
TP_REGISTER_BUDGET = 64
"""Registers per thread for the chunk kernels: their per-element int64 index arithmetic (a
``(w, outer, width, inner)`` decomposition, divisions included) costs more than the packing
kernels' per-block tables; 64 x 128 threads still lets 8 blocks share an SM."""


def _tp_id(op: str, dtype: str, mode: str) -> str:
    return f"{op}-{dtype}-{mode}"


def _tp_kernel_call(op: str, dtype: str, mode: str) -> object:
    """The op's own launch for a (2 ranks, 4 x 1000 x 64) chunk of ``dtype``, with the CUDA block."""
    import importlib

    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    module = importlib.import_module(f"overlap_kernels.{op}")
    full = torch.zeros(4, 1000, 64, dtype=torch_dtype)
    buf = torch.zeros(2, 4, 500, 64, dtype=torch_dtype)
    starts, lengths = [0, 500], [500, 500]
    extents = (4, 500, 64)
    if op == "chunk_place":
        call = module._KernelCall(full, buf, starts, lengths, 1, 0, extents)
    else:
        epilogue = mode == "scale+bias"
        call = module._KernelCall(buf, full, starts, lengths, 1, torch.zeros(64, dtype=torch_dtype) if epilogue else None,
                                  0.5 if epilogue else None, extents)
    call.kwargs["BLOCK"] = 1024  # what a CUDA launch uses (chunk_layout.launch_block)
    return call


QUANTIZED_OPS = ("quantized_copy_in", "quantized_all_gather_copy_out", "quantized_reduce_scatter_copy_out")
QUANTIZED_CASES = [(op, fmt, per_program) for op in QUANTIZED_OPS for fmt in ("int8", "fp8") for per_program in (1, None)]
"""The quantized kernels ([Note: decoding e4m3 without sign arithmetic]): op, format, blocks per
program (``None``: the runtime's choice)."""
PACKED_16BIT_INTEGER = re.compile(r"\b(?:add|sub|mul|mad|min|max|neg|abs|shl|shr|and|or|xor)(?:\.[a-z]+)*\.[sub]16x2\b")
"""PTX packed 16-bit integer arithmetic (``add.s16x2`` and kin)."""


def _quantized_id(op: str, fmt: str, per_program: int | None) -> str:
    return f"{op}-{fmt}-{per_program or 'auto'}"


@dataclasses.dataclass
class _RecordedCall:
    kernel: object
    args: tuple
    kwargs: dict

    def arguments(self) -> tuple[tuple, dict]:
        return self.args, dict(self.kwargs)


def _quantized_kernel_call(op: str, fmt: str, per_program: int | None) -> _RecordedCall:
    """The quantized op's launch, recorded instead of run, with a CUDA launch's options, on the
    layout where the first fp8 decode failed on an H100: 3 ranks, block 256, fp32/bf16/fp16
    parameters, partial blocks (the masked path) and an aligned full-block path."""
    import importlib

    import torch

    from overlap_kernels import ShardLayout, _launch
    from overlap_kernels import quantized_layout as ql

    module = importlib.import_module(f"overlap_kernels.{op}")
    calls = []

    def record(kernel, table, pointers, *args, **constexprs):
        kwargs, options = ql.launch_arguments(table, pointers, constexprs)
        calls.append(_RecordedCall(kernel, (table.blocks, pointers.pointers, *args), {**kwargs, **options}))

    module.launch = record  # this subprocess only compiles: nothing else launches here
    _launch.triton_enabled = lambda device: True  # CPU tensors stand in for CUDA ones
    ql.BLOCKS_PER_PROGRAM = per_program
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    shapes = [(4097, 33), (7,), (), (0, 5), (1000,), (129, 64)]
    layout = ShardLayout(shapes, 3)
    qlayout = ql.QuantizedLayout(layout, 256, fmt)
    buffer = torch.zeros(qlayout.buffer_bytes, dtype=torch.uint8)
    if op == "quantized_copy_in":
        module._quantized_copy_in([torch.zeros(layout.shard_shape(i, 0), dtype=dtypes[i % 3])
                                   for i in range(len(shapes))], qlayout, 0)
    elif op == "quantized_all_gather_copy_out":
        module._quantized_all_gather_copy_out(buffer, qlayout, [torch.empty(s, dtype=torch.bfloat16) for s in shapes])
    else:
        grads = [torch.zeros(layout.shard_shape(i, 0), dtype=dtypes[i % 3]) for i in range(len(shapes))]
        module._quantized_reduce_scatter_copy_out(buffer, grads, qlayout, 0, 1 / 3, True)
    (call,) = calls
    return call


CASE_PARAMETERS: dict[str, tuple[Callable[[Any], str], Callable[[Any], object], list]] = {
    "case": (operator.attrgetter("id"), _kernel_call, CASES + MIXED_CASES),
    "tp_case": (lambda v: _tp_id(*v), lambda v: _tp_kernel_call(*v), TP_CASES),
    "quantized_case": (lambda v: _quantized_id(*v), lambda v: _quantized_kernel_call(*v), QUANTIZED_CASES),
}
"""A test parameter that names a compiled case -> (its compile id, the kernel call to compile, every
value it takes): what the compile subprocess compiles and what the selected tests read, in one place."""


def _ptxas_version(arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas_version

    return get_ptxas_version(arch)


def _compile_all(out: str, arch: int, wanted: set[str]) -> None:
    """The cases whose ids are in ``wanted`` compiled for ``arch``, the reports written to ``out``
    (JSON, keyed ``{id}-sm{arch}``)."""
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True
    results = {}
    for compile_id, make, values in CASE_PARAMETERS.values():
        for value in values:
            if (cid := compile_id(value)) in wanted:
                results[f"{cid}-sm{arch}"] = _compile(make(value), arch)
    Path(out).write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------- tests
def _bundled_ptxas() -> Path | None:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    path = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return path if path.exists() else None


pytestmark = pytest.mark.skipif(_bundled_ptxas() is None, reason="needs Triton's NVIDIA backend with its bundled ptxas")


def _case_id(name: str, value: object) -> str | None:
    """The compile id of a test's parameter ``name`` = ``value`` (None: not a case)."""
    kind = CASE_PARAMETERS.get(name)
    return None if kind is None else kind[0](value)


def _selected_case_ids(items: list[pytest.Item]) -> set[str]:
    """The compile ids the selected tests of this module read, and always the first case (the
    toolchain test reads whichever packing cases were compiled)."""
    wanted = {CASES[0].id}
    for item in items:
        if item.module.__name__ == __name__ and hasattr(item, "callspec"):
            wanted.update(filter(None, (_case_id(k, v) for k, v in item.callspec.params.items())))
    return wanted


@pytest.fixture(scope="session")
def compiled(request: pytest.FixtureRequest) -> dict[str, dict]:
    """The cases the selected tests read (:func:`_selected_case_ids`) compiled for every target,
    once per session: a subprocess per target, side by side (each is one core's work for up to a
    minute)."""
    wanted = sorted(_selected_case_ids(request.session.items))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")}
    # This checkout's kernels, whatever an installed copy points at (a script's sys.path[0] is its folder).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for arch in TARGETS:  # a fresh cache each: every compile runs ptxas; output to a file (no pipe to fill)
            with open(Path(tmp, f"sm{arch}.log"), "w") as log:
                procs[arch] = subprocess.Popen(
                    [sys.executable, __file__, str(Path(tmp, f"sm{arch}.json")), str(arch), *wanted], cwd=REPO,
                    env=dict(env, TRITON_CACHE_DIR=str(Path(tmp, f"cache{arch}"))), stdout=log,
                    stderr=subprocess.STDOUT)
        results: dict[str, dict] = {}
        failed = []
        for arch, proc in procs.items():
            if proc.wait(timeout=600) != 0:
                failed.append(f"sm_{arch}:\n{Path(tmp, f'sm{arch}.log').read_text()[-10000:]}")
            else:
                results.update(json.loads(Path(tmp, f"sm{arch}.json").read_text()))
        if failed:
            raise RuntimeError("the AOT compile subprocess failed: " + "\n".join(failed))
        return results


# [Note: fp16 cases under slow]: a case that reads or writes fp16 (every kernel; 5 of the 9 dtype
# pairs) is under `slow`, so the default suite compiles 54 cases per target instead of 97 (test_aot_compile
# took 69-74 s of the default suite on the 2-core CI box, the most of any fixture, cold or warm:
# every compile runs ptxas). fp16 and bf16 take the same 16-bit paths (vector widths, registers);
# the default suite still compiles fp16 conversions in each kernel's mixed-dtype launch.
def _param(dtypes: tuple[str, ...], *values: object, id: str) -> object:
    """``pytest.param(*values)``, under ``slow`` where ``dtypes`` (what the case reads and writes)
    hold fp16."""
    marks = [pytest.mark.slow] if "fp16" in dtypes else []
    return pytest.param(*values, id=id, marks=marks)


@pytest.mark.parametrize("case", [_param((case.src, case.dst), case, id=case.id) for case in CASES + MIXED_CASES])
def test_aot_compile_launch_configuration(compiled: dict[str, dict], case: Case) -> None:
    """What the launcher hands Triton: argument types, 16-byte divisible pointers, constexprs."""
    r = compiled[f"{case.id}-sm90"]
    flat = case.dst if FLAT_IS_DESTINATION[case.op] else case.src
    param_side = case.src if FLAT_IS_DESTINATION[case.op] else case.dst
    groups = MIXED if param_side == "mixed" else (param_side,)
    sig = r["signature"]
    assert [sig["blocks_ptr"], sig["runs_ptr"], sig["pointers_ptr"]] == ["*i32", "*i64", "*i64"]
    flat_arg = {"all_gather_copy_in": "slot_ptr", "all_gather_copy_out": "buffer_ptr",
                "reduce_scatter_copy_in": "buffer_ptr", "reduce_scatter_copy_out": "slot_ptr"}[case.op]
    assert sig[flat_arg] == f"*{flat}"
    assert r["divisible16"] == sorted(["blocks_ptr", "runs_ptr", "pointers_ptr", flat_arg])
    c = r["constexprs"]
    assert [c[f"DT{g}"] for g in range(len(groups))] == list(groups) and c["NUM_GROUPS"] == str(len(groups))
    assert (c["BLOCK"], c["CHUNK"], r["num_warps"]) == (str(BLOCK), str(CHUNK), NUM_WARPS)
    assert c["VEC"] == str(16 // case.widest_dst)
    assert r["enable_fp_fusion"] is False
    if case.op.startswith("reduce_scatter"):
        assert sig["scale"] == "fp32" and c["HAS_SCALE"] == str("scale" in case.mode)
    if case.op == "reduce_scatter_copy_out":
        assert c["ACCUMULATE"] == str("accumulate" in case.mode)


ALL = [_param((case.src, case.dst), case, arch, id=f"{case.id}-sm{arch}") for case in CASES for arch in TARGETS]
ALL_MIXED = [_param((case.src, case.dst), case, arch, id=f"{case.id}-sm{arch}")
             for case in MIXED_CASES for arch in TARGETS]


@pytest.mark.parametrize(("case", "arch"), ALL + ALL_MIXED)
def test_aot_compile_resources(compiled: dict[str, dict], case: Case, arch: int) -> None:
    """No spills, registers within budget, no shared memory (no layout conversion)."""
    r = compiled[f"{case.id}-sm{arch}"]
    assert (r["spill_stores"], r["spill_loads"], r["stack"]) == (0, 0, 0)
    assert r["registers"] <= (MIXED_REGISTER_BUDGET if case.mixed else REGISTER_BUDGET), r["registers"]
    assert r["shared"] == 0


def expected_vector_accesses(case: Case) -> Counter:
    """Vector instructions of the aligned unmasked path: ``VEC`` elements per thread on both sides
    ([Note: per-thread width]), in pieces of at most 16 bytes."""
    vec = 16 // DTYPES[case.dst]
    out: Counter = Counter()

    def side(kind: str, nbytes: int) -> None:
        piece = min(16, vec * nbytes)  # bytes per instruction
        out[f"{kind}.global.v{piece // 4}.b32"] += ELEMENTS_PER_THREAD * nbytes // piece

    side("ld", DTYPES[case.src])
    side("st", DTYPES[case.dst])
    if "accumulate" in case.mode:
        side("ld", DTYPES[case.dst])  # the gradients read back
    return out


@pytest.mark.parametrize(("case", "arch"), ALL)
def test_aot_compile_vector_accesses(compiled: dict[str, dict], case: Case, arch: int) -> None:
    accesses = compiled[f"{case.id}-sm{arch}"]["accesses"]
    vector = Counter({k: n for k, n in accesses.items() if re.search(r"\.v\d", k)})
    assert vector == expected_vector_accesses(case)
    assert vector["st.global.v4.b32"] == ELEMENTS_PER_THREAD * DTYPES[case.dst] // 16  # 128-bit stores


@pytest.mark.parametrize(("case", "arch"), ALL_MIXED)
def test_aot_compile_vector_accesses_mixed(compiled: dict[str, dict], case: Case, arch: int) -> None:
    """Three dtype groups, a branch each: 128-bit stores (the widest destination's 4 elements per
    thread), and no vector access wider than 128 bits."""
    accesses = compiled[f"{case.id}-sm{arch}"]["accesses"]
    assert accesses.get("st.global.v4.b32", 0) > 0
    assert all(re.search(r"\.v[24]\.b32$", k) for k in accesses if re.search(r"\.v\d", k)), accesses


@pytest.mark.parametrize(("tp_case", "arch"), [_param((c[1],), c, a, id=f"{_tp_id(*c)}-sm{a}")
                                               for c in TP_CASES for a in TARGETS])
def test_aot_compile_chunk_kernels(compiled: dict[str, dict], tp_case: tuple[str, str, str], arch: int) -> None:
    """The chunk kernels compile for sm_80/sm_90: no spills, no shared memory, registers within
    ``TP_REGISTER_BUDGET``, 16-byte divisible buffers, and the epilogue without fused multiply-adds
    (``enable_fp_fusion=False``: it rounds as the torch reference does)."""
    op, dtype, mode = tp_case
    r = compiled[f"{_tp_id(*tp_case)}-sm{arch}"]
    assert (r["spill_stores"], r["spill_loads"], r["stack"], r["shared"]) == (0, 0, 0, 0), r
    assert r["registers"] <= TP_REGISTER_BUDGET, r["registers"]
    full_arg, buf_arg = ("full_ptr", "buf_ptr") if op == "chunk_place" else ("src_ptr", "buf_ptr")
    assert {full_arg, buf_arg} <= set(r["divisible16"]), r["divisible16"]
    assert r["signature"][buf_arg] == f"*{dtype}"
    if mode == "scale+bias":
        assert r["enable_fp_fusion"] is False and r["constexprs"]["HAS_BIAS"] == "True"
        assert r["fma"] == 0, "the epilogue must not fuse its multiply and add"


@pytest.mark.parametrize(("quantized_case", "arch"), [(c, a) for c in QUANTIZED_CASES for a in TARGETS],
                         ids=[f"{_quantized_id(*c)}-sm{a}" for c in QUANTIZED_CASES for a in TARGETS])
def test_aot_compile_quantized_kernels(compiled: dict[str, dict], quantized_case: tuple, arch: int) -> None:
    """The quantized kernels compile for sm_80/sm_90 without spills, without FMA contraction (the
    bitwise contract with the torch fallback), without packed 16-bit integer arithmetic
    ([Note: decoding e4m3 without sign arithmetic] in ``overlap_kernels/block_quantization.py``), and with
    no e4m3 / e5m2 conversion: fp8 is an integer encoding, so it compiles below fp8 hardware (sm_89)
    too ([Note: why the arithmetic is bitwise portable]). The layout has aligned full blocks, so
    the vector path is compiled in, as vector loads or stores ([Note: the aligned full-block path])."""
    r = compiled[f"{_quantized_id(*quantized_case)}-sm{arch}"]
    assert (r["spill_stores"], r["spill_loads"], r["stack"]) == (0, 0, 0), r
    assert r["enable_fp_fusion"] is False and r["fma"] == 0
    assert r["packed_16bit_integer_ops"] == []
    assert r["fp8_conversions"] == 0
    assert r["constexprs"]["VECTOR"] == "True", r["constexprs"]
    assert any(re.search(r"\.v[248]\.", access) for access in r["accesses"]), r["accesses"]


@pytest.mark.parametrize("arch", TARGETS)
def test_aot_compile_toolchain(compiled: dict[str, dict], arch: int) -> None:
    """The PTX ISA and ptxas behind each target, on which the driver requirement (module
    docstring) rests."""
    import triton

    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    if version not in TOOLCHAIN:
        pytest.skip(f"no toolchain recorded for Triton {triton.__version__} (recorded: "
                    f"{sorted(TOOLCHAIN)}): record it and revisit the driver statement above")
    target, ptx_version, release = TOOLCHAIN[version][arch]
    packing = [compiled[key] for key in (f"{case.id}-sm{arch}" for case in CASES + MIXED_CASES) if key in compiled]
    assert packing, "the fixture compiles at least the first case"
    for r in packing:
        assert (r["ptx_target"], r["ptx_version"], r["ptxas_release"]) == (target, ptx_version, release)


if __name__ == "__main__":
    _compile_all(sys.argv[1], int(sys.argv[2]), set(sys.argv[3:]))
