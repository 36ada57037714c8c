"""``python -m overlap check-gpu`` (``overlap.testing.gpu_check``), on the CPU: its packing and
training checks run here on the interpreted kernels and gloo, catch a kernel that skips an output,
and the command without a GPU exits 2 with a message.

The rows that need a GPU (streams, CUDA graphs, the GPU tests, bench_kernels) run when the command
runs on a GPU machine.
"""
from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlap_kernels import _jit
from overlap.testing import gpu_check
from overlap.testing.gpu_check import CheckRow, PackingCase, check_packing_case, draw_packing_cases, format_table

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
interpreted = pytest.mark.skipif(not _jit.INTERPRET, reason="the check runs the Triton kernels: needs "
                                                            "TRITON_INTERPRET=1 on the CPU (conftest sets it without a GPU)")


@interpreted
def test_drawn_packing_cases_match_the_references() -> None:
    cases = draw_packing_cases(8, seed=3)
    assert {c.world_size for c in cases} >= {1, 8} and any(c.accumulate for c in cases)
    assert [p for case in cases for p in check_packing_case(case, CPU)] == []


def test_draws_are_reproducible_and_the_big_case_is_multi_gib() -> None:
    assert draw_packing_cases(20, seed=5) == draw_packing_cases(20, seed=5)
    big = draw_packing_cases(3, seed=5, big=True)[-1]
    assert max(math.prod(s) for s in big.shapes) * 4 > 2**31


@interpreted
def test_an_output_the_kernel_skips_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN: a copy-out that leaves the last parameter unwritten is reported."""
    module = importlib.import_module("overlap_kernels.all_gather_copy_out")  # the package exports the function by that name
    real = module._all_gather_copy_out

    def skips_the_last(ag_output: torch.Tensor, layout: object, outs: list[torch.Tensor], *rest: object,
                       **options: object) -> None:
        kept = outs[-1].clone()
        real(ag_output, layout, outs, *rest, **options)
        outs[-1].copy_(kept)

    monkeypatch.setattr(module, "_all_gather_copy_out", skips_the_last)
    case = PackingCase(seed=7, shapes=((5, 3), (7,)), param_dtypes=(torch.float32,), buffer_dtype=None,
                       world_size=2, rank=1, scale=None, accumulate=False)
    problems = check_packing_case(case, CPU)
    assert len(problems) == 1 and "all_gather_copy_out differs" in problems[0], problems


@pytest.mark.torch_kernels
def test_training_checks_pass_on_one_gloo_rank(distributed) -> None:
    """The training row's comparisons, on a 1-rank gloo group: every one holds (bitwise where the
    check says so)."""
    (results,) = distributed(gpu_check.training_checks, 1, "cpu", timeout=300)
    assert [name for name, _, _ in results] == [
        "fp32 vs unsharded", "fp32 vs FSDP2", "bf16 vs FSDP2", "optimizer in backward vs plain step",
        "1x1 HSDP vs FSDP2", "compiled blocks vs eager"]
    assert all(ok for _, ok, _ in results), results


def test_table_names_the_failed_rows() -> None:
    rows = [CheckRow("a", True, 1.0, "fine"), CheckRow("b", False, 2.0, "wrong"), CheckRow("c", None, 0.0, "why")]
    table = format_table(rows, "title")
    assert table.splitlines()[0] == "title"
    assert "PASS" in table and "FAIL" in table and "SKIP" in table
    assert table.splitlines()[-1] == "FAILED: b"
    assert format_table(rows[::2], "t").splitlines()[-1] == "all checks that ran passed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the command without a GPU")
def test_command_without_a_gpu_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "overlap", "check-gpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr, (proc.returncode, proc.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the options would start the whole benchmark")
def test_the_kernel_benchmark_row_passes_options_the_benchmark_accepts() -> None:
    # Without a GPU the script stops at its device check, which comes after its options are parsed: a
    # misspelt or removed option would end it on argparse's "unrecognized arguments" instead.
    options = gpu_check.BENCHMARKS["bench_kernels"]
    proc = subprocess.run([sys.executable, "benchmarks/bench_kernels.py", *options, "--markdown", "unused.md"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--device cuda: no CUDA device here" in proc.stderr, proc.stderr[-500:]
    assert not (REPO / "unused.md").exists()


def test_the_suite_row_runs_the_default_selection_with_cores_left_for_the_ranks() -> None:
    argv = gpu_check.suite_argv("python3", cpus=16, has_xdist=True)
    assert argv[:3] == ["python3", "-m", "pytest"] and argv[-1] == "tests"
    assert argv[argv.index("-n") + 1] == "14"
    assert "-m" not in argv[3:], "a marker selection would leave out part of the default suite"
    assert "-rfEs" in argv, "the log must say which tests were skipped on the GPU machine, and why"
    assert gpu_check.suite_argv("python3", cpus=2, has_xdist=True)[-2:] == ["1", "tests"]
    assert "-n" not in gpu_check.suite_argv("python3", cpus=16, has_xdist=False)
    from overlap.demo.cli import build_parser

    assert build_parser().parse_args(["check-gpu", "--suite"]).suite


def test_a_started_row_reports_its_process_once_it_ends_or_its_time_is_up() -> None:
    # The GPU tests' row starts first and is collected after the in-process rows.
    summary = gpu_check._pytest_summary
    done = gpu_check._started_row("ok", [sys.executable, "-c", "print('3 passed in 0.1s')"], REPO, summary)
    failing = gpu_check._started_row("bad", [sys.executable, "-c", "raise SystemExit(3)"], REPO, summary)
    slow = gpu_check._started_row("slow", [sys.executable, "-c", "import time; time.sleep(30)"], REPO, summary)
    row = done(60)
    assert row.ok is True and row.detail == "3 passed", row
    row = failing(60)
    assert row.ok is False and row.detail.startswith("exit 3"), row
    row = slow(0.5)
    assert row.ok is False and "did not finish in 0 s" in row.detail and row.seconds < 10, row
    missing = gpu_check._started_row("absent", [sys.executable, "-c", "pass"], REPO / "no-such-folder", summary)
    assert missing(1).ok is None


def test_log_dir_keeps_each_subprocess_rows_whole_output(tmp_path) -> None:
    # The table keeps one summary line per row; --log-dir keeps what a failure needs to be read later
    # (a GPU machine's files come back only from one folder), also for a row whose time ran out.
    summary = gpu_check._pytest_summary
    script = "import sys; print('first line'); print('to stderr', file=sys.stderr); print('2 passed in 0.1s')"
    row = gpu_check._started_row("gpu tests", [sys.executable, "-c", script], REPO, summary, tmp_path)(60)
    assert row.ok is True and row.detail == "2 passed", row
    text = gpu_check.log_path(tmp_path, "gpu tests").read_text()
    assert gpu_check.log_path(tmp_path, "gpu tests").name == "gpu-tests.log"
    assert "first line" in text and "to stderr" in text and "2 passed" in text, text
    slow = "import time; print('started', flush=True); time.sleep(30)"
    row = gpu_check._started_row("default suite", [sys.executable, "-c", slow], REPO, summary, tmp_path)(3)
    assert row.ok is False and "did not finish" in row.detail, row
    assert "started" in gpu_check.log_path(tmp_path, "default suite").read_text()
    from overlap.demo.cli import build_parser

    assert build_parser().parse_args(["check-gpu", "--log-dir", str(tmp_path)]).log_dir == tmp_path


def test_the_native_passes_row_checks_each_pass_against_its_definition() -> None:
    """On this machine's CPU tensors (CI builds the extension); the row skips where it cannot build."""
    from overlap_kernels import native_passes

    row = gpu_check.native_passes_row(torch.device("cpu"))
    if native_passes.loaded() is None:
        assert row.ok is None and native_passes.status() in row.detail
    else:
        assert row.ok is True, row.detail
