"""The exit codes of a training process, in one place (docs/running.md "Exit codes",
docs/multinode.md). Standard library only: the launchers' helpers read it without torch.

A launcher script (megatron_dpp.rank_launcher around torchrun) ends with the code of the rank that
failed first, so a node's exit code is one of these too.
"""

OK = 0
"""Training finished, or stopped by --exit-interval or --exit-duration-in-mins (Megatron-LM's)."""

FAILED = 1
"""An error without a code of its own: a Python exception (its traceback says what), or a
checkpoint save that failed (one line)."""

BAD_INPUT = 2
"""A bad flag, data path or checkpoint: one line that says what to fix, before training starts."""

STALLED = 3
"""No progress for --dpp-timeout (the DPP runtime or its watchdog): the rank printed what it was
waiting for."""

LOST_PEER = 4
"""Another rank is gone: its connection reset (its process died) or its heartbeats stopped (its
process is stopped or frozen, its node hangs, or the link to it is down). The report names the
peer's rank, node and address."""

SIGNAL_BASE = 128
"""128 + N: stopped by signal N (SIGINT, SIGTERM) at an iteration boundary, after saving with
--save; or killed by signal N."""
