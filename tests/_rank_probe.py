"""A rank for tests/test_forked_ranks.py: `python -m _rank_probe MODE` (cwd tests/), started forked
or under torchrun; MODE says what each rank does."""
import atexit
import json
import os
import sys
import time

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_RUN_ID", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS")


def say(line: str) -> None:
    """One write per line: the ranks share the pipe, and print() unbuffered (PYTHONUNBUFFERED)
    writes the text and its newline apart, so two ranks' lines could interleave. A write below
    PIPE_BUF (4096 bytes) lands whole."""
    os.write(1, (line + "\n").encode())


rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode == "env":  # what the rank sees, as one JSON line
    say("probe " + json.dumps({
        "rank": rank, "hash": hash("megatron-dpp"), "name": __name__, "argv": sys.argv,
        "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(), "session": os.getsid(0),
        "variables": {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}}))
elif mode == "imports":  # train GPT with the flags that follow, then list what that imported
    before = set(sys.modules)
    from megatron_dpp.pretrain import main

    code = main(sys.argv[2:], model="gpt")
    say("probe imports " + json.dumps(sorted(set(sys.modules) - before)))
    sys.exit(code)
elif mode == "fail":  # rank 1 fails; rank 0 would run on
    if rank == 1:
        time.sleep(0.5)
        sys.exit(3)
    say(f"probe pid {os.getpid()}")
    time.sleep(120)
elif mode == "hang":
    say(f"probe pid {os.getpid()}")
    time.sleep(600)
elif mode == "atexit":  # the interpreter's own exit: atexit handlers, then SystemExit's code
    atexit.register(lambda: say(f"probe atexit ran on rank {rank}"))
    sys.exit(4 if rank == 0 else 0)
