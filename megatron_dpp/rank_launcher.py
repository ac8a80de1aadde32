"""`python -m megatron_dpp.rank_launcher <torchrun's flags> -m MODULE ARGS...`: torchrun, ending
with one line when ranks fail.

torchrun reports failed ranks with a ChildFailedError traceback and a table that often names a
healthy rank (the first one it noticed, to the second). Here the ranks record their one-line error
(megatron_dpp.rank_failure) in a folder this launcher gives them; when torchrun reports a failure,
the launcher's last line is the line of the rank that failed first, by time, and its exit code is
that rank's. A rank that died without a line (a crash, a signal) is named with its host and exit
status; one killed by a signal (kill -9, the OOM killer) comes first, before the line a peer then
recorded (a lost peer). A rank stopped by a signal when the job ends is killed at once
(megatron_dpp.stopped_ranks), not after torchrun's 30 s. The folder, torchrun's log folder inside
it, is removed when the launcher ends: a job leaves nothing in TMPDIR.

`--ranks-per-gpu N`, before torchrun's flags (the run scripts' RANKS_PER_GPU=N): N ranks share each
GPU (megatron_dpp.shared_gpu): the launcher starts a private MPS control daemon, gives the ranks
its directories, their SM share and N, says so in its first line, and stops the daemon however
the job ends (normal end, a failing rank, SIGINT/SIGTERM to the launcher). Refused in one line,
exit 2, before anything starts, where N does not divide the node's ranks or
`nvidia-cuda-mps-control` is not on PATH.

A job of one node gets its rendezvous store, gloo's and NCCL's sockets on 127.0.0.1
(megatron_dpp.loopback_store) and, where the environment holds none, a fresh job key
(DPP_JOB_KEY, megatron_dpp.comm.job_key) that authenticates its heartbeats.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
from typing import Optional, Sequence

from megatron_dpp.comm.job_key import JOB_KEY_ENV, new_job_key
from megatron_dpp.exit_codes import BAD_INPUT
from megatron_dpp.loopback_store import (LoopbackStore, StoreBindError, loopback_port_wanted,
                                         sockets_on_loopback)
from megatron_dpp.rank_failure import FAILURE_DIR_ENV, all_failures, first_failure
from megatron_dpp.shared_gpu import MpsDaemon, MpsError, Stopped, layout_error, raise_stopped
from megatron_dpp.stopped_ranks import StoppedRankWatch

PROG = "megatron_dpp.rank_launcher"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _killed_rank(error, folder: str) -> Optional[tuple[int, int]]:
    """(rank, signal number) of the first rank torchrun saw killed by a signal that recorded no
    line (kill -9, the OOM killer), or None: what the others' lines (a lost peer) follow. SIGTERM
    is left out: torchrun stops the other ranks with it once one has failed."""
    recorded = {failure.rank for failure in all_failures(folder)}
    killed = sorted((failure.timestamp, rank, -failure.exitcode)
                    for rank, failure in error.failures.items()
                    if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM
                    and rank not in recorded)
    return (killed[0][1], killed[0][2]) if killed else None


def _failure_line(error, folder: str) -> tuple[str, int]:
    """(the launcher's last line, its exit code) when torchrun reports failed ranks."""
    recorded = first_failure(folder)
    killed = _killed_rank(error, folder)
    if killed is not None:  # the shell's convention for a signal: 128 + its number
        rank, number = killed
        then = (f"then: {recorded.line}" if recorded is not None
                else "its output above says what it was doing")
        return (f"{PROG}: rank {rank} on {socket.gethostname()} was killed by "
                f"{_signal_name(number)}; {then}"), 128 + number
    if recorded is not None:
        return recorded.line, recorded.exit_code
    rank, failure = error.get_first_failure()
    return (f"{PROG}: rank {rank} on {socket.gethostname()} failed with exit code "
            f"{failure.exitcode}; its output above says why"), failure.exitcode or 1


def split_ranks_per_gpu(argv: Sequence[str]) -> tuple[Optional[int], list[str]]:
    """(N of a leading `--ranks-per-gpu N`, or None; torchrun's words). ValueError for a bad N."""
    words = list(argv)
    if not words or words[0].split("=", 1)[0] != "--ranks-per-gpu":
        return None, words
    if "=" in words[0]:
        value, rest = words[0].split("=", 1)[1], words[1:]
    elif len(words) >= 2:
        value, rest = words[1], words[2:]
    else:
        raise ValueError("--ranks-per-gpu needs a number (the ranks that share one GPU)")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--ranks-per-gpu {value}: expected a positive whole number")
    return int(value), rest


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        per_gpu, words = split_ranks_per_gpu(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return BAD_INPUT
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(words)
    if per_gpu is not None:
        problem = (layout_error(per_gpu, int(args.nproc_per_node), None)
                   if str(args.nproc_per_node).isdigit() else
                   f"--ranks-per-gpu needs a number of processes per node (--nproc-per-node "
                   f"{args.nproc_per_node})")
        if problem is not None:
            print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
            return BAD_INPUT
    previous = {number: signal.signal(number, raise_stopped)
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.ExitStack() as job:
            if per_gpu is not None:
                try:
                    daemon = job.enter_context(MpsDaemon(per_gpu))
                except MpsError as error:
                    print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
                    return BAD_INPUT
                os.environ.update(daemon.environment)  # the ranks inherit them
                print(f"{PROG}: {daemon.banner(int(args.nproc_per_node))}", flush=True)
            port = loopback_port_wanted(args)
            if port is not None:  # one node: nothing of the job listens beyond this machine
                try:
                    job.enter_context(LoopbackStore(port)).use_in(args)
                except StoreBindError as error:
                    print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
                    return BAD_INPUT
                if "--multi-node" not in args.training_script_args:  # else --node-ips chooses
                    sockets_on_loopback(os.environ)  # gloo's and NCCL's; the ranks inherit them
                os.environ.setdefault(JOB_KEY_ENV, new_job_key())
            return _run(torchrun, args)
    except Stopped as stop:  # before torchrun started the ranks, or after they ended
        return 128 + stop.number
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _run(torchrun, args) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with tempfile.TemporaryDirectory(prefix="dpp-failures-") as folder:
        os.environ[FAILURE_DIR_ENV] = folder  # the ranks inherit it
        if args.log_dir is None:
            # torchrun's default log folder, $TMPDIR/torchelastic_*, is never removed: one left per
            # job. Inside this folder it goes with it (a --log-dir of the user's stays theirs).
            args.log_dir = os.path.join(folder, "torchrun-logs")
        watch = StoppedRankWatch(folder)  # no 30 s wait for a rank that cannot act on SIGTERM
        watch.start()
        try:
            torchrun.run(args)
        except ChildFailedError as error:
            line, code = _failure_line(error, folder)
            print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as stop:
            # SIGTERM/SIGINT to the launcher: torchrun has passed it on and the ranks, which stop
            # at an iteration boundary and save, have said so; end as a signalled process does.
            return 128 + int(stop.sigval)
        finally:
            watch.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
