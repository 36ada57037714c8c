"""What every benchmark prints with its table: machine, date, versions, git sha; and a markdown table."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import Sequence

import torch


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
        # RESULTS.md itself does not count: a benchmark appending several tables dirties it.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ":(top,exclude)benchmarks/RESULTS.md"], capture_output=True,
                               text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({os.cpu_count()} CPU cores)"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def environment() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return (f"machine: {machine()}; date: {datetime.date.today().isoformat()}; torch {torch.__version__}; "
            f"triton {triton_version}; git {git_sha()}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def emit(title: str, header: Sequence[str], rows: Sequence[Sequence[object]], markdown_path: str | None) -> str:
    """Print the table with its environment line; append it to ``markdown_path`` if given."""
    text = f"### {title}\n\n{environment()}\n\n{markdown_table(header, rows)}\n"
    print(text)
    if markdown_path:
        with open(markdown_path, "a") as f:
            f.write("\n" + text)
    return text
