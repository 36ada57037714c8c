"""``python -m overlap``: help lists every option; bad input gets argparse's usage and exit code 2 before
any training starts. (The demo's end-to-end runs are in ``test_demo.py``.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import overlap.demo.run
from overlap import Compression
from overlap.demo.cli import build_parser, main, max_world_size
from overlap.demo.run import COMPRESSIONS, DemoConfig

DEMO_OPTIONS = ("--world-size", "--steps", "--model", "--compare", "--link-gbps", "--latency-us", "--profile-steps",
                "--device", "--out", "--compress")


def test_module_entry_point_help_explains_every_option() -> None:
    done = subprocess.run([sys.executable, "-m", "overlap", "demo", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for option in DEMO_OPTIONS:
        assert option in done.stdout
    for word in ("small", "medium", "fsdp2", "no-overlap", "torchrun", "gigabits", "trace", "timeline"):
        assert word in done.stdout, word


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be rejected before the demo trains: running it fails the test."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started training on bad input")

    monkeypatch.setattr(overlap.demo.run, "run_demo", fail)
    monkeypatch.setattr(overlap.demo.run, "rank_main", fail)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--world-size", "1"], "--world-size: must be >= 2"),
        (["demo", "--steps", "0"], "--steps: must be >= 1"),
        (["demo", "--steps", "two"], "--steps: must be a whole number"),
        (["demo", "--profile-steps", "-1"], "--profile-steps: must be >= 0"),
        (["demo", "--model", "huge"], "--model: invalid choice: 'huge'"),
        (["demo", "--compare", "fsdp3"], "--compare: unknown mode 'fsdp3'"),
        (["demo", "--compare", "fsdp2,"], "--compare: unknown mode ''"),
        (["demo", "--link-gbps", "-1"], "--link-gbps: must be a finite number > 0"),
        (["demo", "--latency-us", "nan"], "--latency-us: must be a finite number >= 0"),
        (["demo", "--device", "tpu"], "--device: invalid choice: 'tpu'"),
        (["demo", "--mesh", "4"], "--mesh: must be NODESxRANKS_PER_NODE"),
        (["demo", "--mesh", "2x0"], "--mesh: must be NODESxRANKS_PER_NODE"),
        (["demo", "--mesh", "2x2", "--world-size", "3"], "--mesh 2x2 has 4 ranks but --world-size is 3"),
        (["demo", "--parallel", "pp"], "--parallel: invalid choice: 'pp'"),
        (["demo", "--parallel", "tp", "--compare", "fsdp2"], "--parallel tp runs its own modes"),
        (["demo", "--parallel", "tp", "--mesh", "1x2"], "--compare and --mesh choose FSDP modes"),
        (["demo", "--compress", "fp4"],
         "--compress: unknown format 'fp4': give a comma-separated list of int8, fp8-gather, fp8-reduce, fp8-both"),
        (["demo", "--compress", "int8,fp8"], "--compress: 'fp8' is not a format: give fp8-gather (e4m3 all-gathers, "
                                             "int8 reductions: what 'fp8' ran before), fp8-reduce"),
        (["demo", "--compress", "int8,"], "--compress: unknown format ''"),
        (["demo", "--compress", "fp8-gather", "--mesh", "1x2"], "--compress runs a fully sharded FSDP mode"),
        (["demo", "--compress", "int8", "--mesh", "1x2"], "--compress runs a fully sharded FSDP mode"),
        (["demo", "--compress", "int8", "--parallel", "tp"], "--compress runs a fully sharded FSDP mode"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["launch"], "invalid choice: 'launch'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2_with_usage(argv: list[str], message: str, no_training: None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "usage:" in err and message in err, err


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    assert info.value.code == 2, captured
    assert "usage:" in captured.err
    assert "overlap demo:" not in captured.out, "the demo announced a run before rejecting its input"
    return captured.err


def test_world_size_beyond_the_machine_is_refused(no_training: None, capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_2(["demo", "--device", "cpu", "--world-size", str(max_world_size() + 1)], capsys)
    assert f"--world-size {max_world_size() + 1} is more CPU ranks than this machine can run" in err, err
    assert f"at most {max_world_size()}" in err, err


def test_cuda_without_a_gpu_is_refused(no_training: None, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --device cuda is valid here")
    assert "--device cuda: no CUDA device is visible" in _exit_2(["demo", "--device", "cuda"], capsys)


def test_unwritable_out_fails_before_training(tmp_path: object, no_training: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    blocker = os.path.join(str(tmp_path), "a-file")
    with open(blocker, "w") as f:
        f.write("not a folder")
    out = os.path.join(blocker, "demo-out")  # a folder inside a regular file: unwritable even for root
    err = _exit_2(["demo", "--out", out], capsys)
    assert f"--out {out!r} cannot be written" in err, err


def test_torchrun_world_size_must_agree(no_training: None, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = _exit_2(["demo", "--world-size", "2"], capsys)
    assert "--world-size 2 disagrees with torchrun's WORLD_SIZE=3" in err, err


def test_torchrun_variables_must_be_numbers(no_training: None, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _exit_2(["demo"], capsys)
    assert "torchrun's RANK='zero', WORLD_SIZE='2', LOCAL_RANK='0' must be whole numbers" in err, err


@pytest.mark.parametrize(("value", "formats", "modes"), [
    ("fp8-gather", ("fp8-gather",), ("overlap", "overlap-fp8-gather")),
    ("int8", ("int8",), ("overlap", "overlap-int8")),
    (" fp8-both , int8,fp8-reduce,fp8-both", ("fp8-both", "int8", "fp8-reduce"),
     ("overlap", "overlap-int8", "overlap-fp8-reduce", "overlap-fp8-both")),
])
def test_compress_parses_formats_into_modes_after_the_exact_run(value: str, formats: tuple[str, ...],
                                                                modes: tuple[str, ...]) -> None:
    """``--compress`` takes comma-separated formats (duplicates once); each adds one mode right after the
    exact ``overlap`` run, in the order int8, fp8-gather, fp8-reduce, fp8-both, whatever order they
    were given in."""
    args = build_parser().parse_args(["demo", "--compress", value])
    assert args.compress == formats
    assert DemoConfig(compress=args.compress, compare=()).modes == modes
    assert build_parser().parse_args(["demo"]).compress == ()


def test_compress_selects_the_compression_the_help_names(capsys: pytest.CaptureFixture[str]) -> None:
    """Each format is the Compression its name and the help say; block 256."""
    assert Compression(**COMPRESSIONS["int8"]) == Compression(gather="int8", reduce="int8", block=256) == Compression()
    assert Compression(**COMPRESSIONS["fp8-gather"]) == Compression(gather="fp8", reduce="int8", block=256)
    assert Compression(**COMPRESSIONS["fp8-reduce"]) == Compression(gather="int8", reduce="fp8", block=256)
    assert Compression(**COMPRESSIONS["fp8-both"]) == Compression(gather="fp8", reduce="fp8", block=256)
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    help_text = "".join(text.split())  # argparse wraps lines at spaces and after hyphens
    for phrase in ("int8 = overlap.Compression() (int8 all-gathers and int8 reductions)",
                   "fp8-gather = Compression(gather='fp8', reduce='int8') (e4m3 all-gathers, int8 reductions)",
                   "fp8-reduce = Compression(gather='int8', reduce='fp8') (int8 all-gathers, e4m3 reductions)",
                   "fp8-both = Compression(gather='fp8', reduce='fp8')"):
        assert "".join(phrase.split()) in help_text, text


@pytest.mark.parametrize("compress", ["fp8", ("fp4",), ("fp8",), None])
def test_demo_config_refuses_unknown_compress(compress: object) -> None:
    with pytest.raises(ValueError, match="compress must be a tuple of formats from") as info:
        DemoConfig(compress=compress)  # type: ignore[arg-type]
    assert ("fp8-gather (e4m3 all-gathers, int8 reductions" in str(info.value)) == (compress == ("fp8",)), info.value
