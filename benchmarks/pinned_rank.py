"""A torchrun entry point that pins each rank to a core of its own, then runs megatron_dpp.pretrain_gpt
with the remaining arguments:

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/pinned_rank.py <flags>

Local rank r runs on the r-th core this process may use (modulo their number), so on a 2-core machine
the two ranks of a pp=2 run never take turns on one core, and a timing compares schedules rather
than the kernel's placement. Threads the rank starts later (transport copy threads) inherit its core.
"""
import os
import runpy
import sys


def pin_to_core(index: int) -> None:
    """Run on the (index mod cores)-th core this process may use; threads started later inherit it."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[index % len(cores)]})


def pin_to_own_core() -> None:
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        sys.exit(f"{os.path.basename(sys.argv[0])}: LOCAL_RANK is not set; start it with torchrun "
                 "(python -m torch.distributed.run ... benchmarks/pinned_rank.py FLAGS)")
    pin_to_core(int(local_rank))


def run_pretrain_gpt() -> None:
    sys.argv = ["megatron_dpp.pretrain_gpt", *sys.argv[1:]]
    runpy.run_module("megatron_dpp.pretrain_gpt", run_name="__main__", alter_sys=True)


def main() -> None:
    pin_to_own_core()
    run_pretrain_gpt()


if __name__ == "__main__":
    main()
