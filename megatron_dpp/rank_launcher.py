"""`python -m megatron_dpp.rank_launcher <torchrun's flags> -m MODULE ARGS...`: torchrun, ending
with one line when ranks fail.

torchrun reports failed ranks with a ChildFailedError traceback and a table that often names a
healthy rank (the first one it noticed, to the second). Here the ranks record their one-line error
(megatron_dpp.rank_failure) in a folder this launcher gives them; when torchrun reports a failure,
the launcher's last line is the line of the rank that failed first, by time, and its exit code is
that rank's. A rank that died without a line (a crash, a signal) is named with its exit status.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from typing import Optional, Sequence

from megatron_dpp.rank_failure import FAILURE_DIR_ENV, first_failure

PROG = "megatron_dpp.rank_launcher"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _unrecorded_failure(error) -> tuple[str, int]:
    """(line, exit code) from torchrun's own report, when no rank recorded a line."""
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:  # killed by a signal: the shell's convention, 128 + its number
        return (f"{PROG}: rank {rank} was killed by {_signal_name(-failure.exitcode)}; "
                f"its output above says what it was doing"), 128 - failure.exitcode
    return (f"{PROG}: rank {rank} failed with exit code {failure.exitcode}; "
            f"its output above says why"), failure.exitcode or 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    with tempfile.TemporaryDirectory(prefix="dpp-failures-") as folder:
        os.environ[FAILURE_DIR_ENV] = folder  # the ranks inherit it
        try:
            torchrun.run(args)
        except ChildFailedError as error:
            recorded = first_failure(folder)
            if recorded is not None:
                line, code = recorded.line, recorded.exit_code
            else:
                line, code = _unrecorded_failure(error)
            print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as stop:
            # SIGTERM/SIGINT to the launcher: torchrun has passed it on and the ranks, which stop
            # at an iteration boundary and save, have said so; end as a signalled process does.
            return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
