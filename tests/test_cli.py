"""``python -m overlap``: the demo runs end to end, and bad input gets argparse's usage and exit code 2."""
from __future__ import annotations

import subprocess
import sys

import pytest

from overlap.cli import main, max_world_size


def test_demo_runs_end_to_end_and_modes_agree(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--steps", "1", "--layers", "3", "--hidden", "64", "--link-gbps", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    for mode in ("math only (weights local)", "no overlap", "overlap", "ideal max(compute, comm)"):
        assert mode in rows, out
    # Every mode produced bitwise the activations of the math with local weights.
    assert rows["no overlap"].rstrip().endswith("yes") and rows["overlap"].rstrip().endswith("yes"), out
    assert "emulated link: 5 Gbit/s" in out
    assert "CPU:" in out, "the demo prints the device description"


def test_module_entry_point_prints_help() -> None:
    done = subprocess.run([sys.executable, "-m", "overlap", "demo", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--world-size", "--steps", "--layers", "--hidden", "--link-gbps", "--latency-us"):
        assert option in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--world-size", "0"], "--world-size: must be >= 1"),
        (["demo", "--steps", "two"], "--steps: must be a whole number"),
        (["demo", "--link-gbps", "-1"], "--link-gbps: must be a finite number > 0"),
        (["demo", "--latency-us", "nan"], "--latency-us: must be a finite number >= 0"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["launch"], "invalid choice: 'launch'"),
        ([], "the following arguments are required: COMMAND"),
        (["demo", "--world-size", str(max_world_size() + 1)], "more CPU ranks than this machine can run"),
        (["demo", "--world-size", "3", "--hidden", "64"], "--hidden 64 must be divisible by --world-size 3"),
    ],
)
def test_bad_arguments_exit_2_with_usage(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "usage:" in err and message in err, err
