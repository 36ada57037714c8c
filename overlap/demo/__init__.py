"""The demo app behind ``python -m overlap demo``: not part of the runtime users import.

- :mod:`overlap.demo.cli` — the command line (``python -m overlap``, the ``overlap`` script): parses
  and checks the arguments, then runs the demo spawned or on torchrun's ranks.
- :mod:`overlap.demo.run` — the demo itself: one model trained side by side under each mode behind
  the emulated link, the loss checks, the report table, the trace and timeline files.
- :mod:`overlap.demo.model` — the demo's model and data (a small GPT-style LM, synthetic batches).
- :mod:`overlap.demo.training` — the side-by-side modes (``overlap.shard``, ``no_overlap``, FSDP2),
  the training step and the link calibration; also used by ``benchmarks/``.
"""
