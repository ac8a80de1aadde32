"""A rank for tests/test_rank_launcher.py: `_failing_rank.py MODE`, run by the launcher as torchrun
runs any script. MODE says how each rank ends."""
import os
import signal
import sys
import time

from megatron_dpp.rank_failure import fail

rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode == "lines":  # rank 1 fails first with its line; rank 0 would fail later with another
    if rank == 1:
        time.sleep(0.5)
        fail("rank 1: the first failure", exit_code=5)
    time.sleep(1.5)
    fail("rank 0: a later failure", exit_code=7)
elif mode == "crash":  # no line recorded: an exception's traceback
    if rank == 1:
        raise RuntimeError("an unexpected crash")
    time.sleep(60)
elif mode == "killed_peer_reports":  # rank 1 killed; rank 0, stopped by torchrun, reports it
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: fail("[rank 0] lost the peer", exit_code=4))
        time.sleep(60)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "stopped":  # rank 1 stops itself; rank 0 then reports it lost
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(1.0)
    fail("[rank 0] lost the peer (rank 1)", exit_code=4)
elif mode == "killed":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
elif mode == "ok":
    print(f"rank {rank} done")
