"""Several pipeline ranks on one GPU (`--ranks-per-gpu N`, the run scripts' RANKS_PER_GPU=N).

Rank r of a node runs on GPU r // N. The ranks sharing a GPU run under a private NVIDIA MPS
control daemon (its pipe and log directories under a fresh temporary directory), so that their
kernels run side by side instead of the GPU switching contexts between processes, each limited to
its share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // N). NCCL refuses two ranks of
one communicator on one device, so the collectives go over gloo (parallel/flags.py); gloo stages
CUDA tensors through the host for the operations it lacks on them (comm/collectives.py).

The launcher (megatron_dpp.rank_launcher) starts and stops the daemon; the ranks read
RANKS_PER_GPU_ENV for their device (platform.py) and backend. Standard library only.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Mapping, Optional

RANKS_PER_GPU_ENV = "DPP_RANKS_PER_GPU"
"""What the launcher tells every rank: N ranks share each GPU (unset: one rank per GPU)."""

MPS_CONTROL = "nvidia-cuda-mps-control"
CONTROL_TIMEOUT_S = 30.0
"""How long one call of the control program may take (start, or quit)."""
QUIT_TIMEOUT_S = 10.0
"""How long the daemon may take to end after `quit`."""
PID_FILE = "nvidia-cuda-mps-control.pid"
"""Where the control daemon writes its process id, in its pipe directory."""


def ranks_per_gpu(environ: Mapping[str, str] = os.environ) -> int:
    """N from RANKS_PER_GPU_ENV; 1 when unset. A bad value is the launcher's bug: ValueError."""
    text = environ.get(RANKS_PER_GPU_ENV, "")
    if not text:
        return 1
    value = int(text)
    if value < 1:
        raise ValueError(f"{RANKS_PER_GPU_ENV}={text}: expected a positive whole number")
    return value


def device_index(local_rank: int, per_gpu: int) -> int:
    """The GPU of a node's local rank: consecutive ranks (pipeline neighbours) share one."""
    return local_rank // per_gpu


def sm_percentage(per_gpu: int) -> int:
    """Each rank's share of the GPU's SMs under MPS."""
    return 100 // per_gpu


def shared_gpu_backend(asked: Optional[str], cuda: bool, per_gpu: int) -> str:
    """torch.distributed's backend: --distributed-backend where given; else nccl with CUDA and one
    rank per GPU, gloo otherwise (no CUDA, or ranks sharing a device, which NCCL refuses)."""
    if asked is not None:
        return asked
    return "nccl" if cuda and per_gpu == 1 else "gloo"


def layout_error(per_gpu: int, nproc: int, gpus: Optional[int]) -> Optional[str]:
    """Why N ranks per GPU cannot run NPROC ranks on a node of GPUS GPUs (None: it can; GPUS None:
    not known here)."""
    if per_gpu < 1:
        return f"--ranks-per-gpu {per_gpu}: expected a positive whole number"
    if nproc % per_gpu:
        return (f"--ranks-per-gpu {per_gpu} does not divide the node's {nproc} ranks; "
                f"give a number of ranks that is a multiple of {per_gpu}")
    if gpus is not None and nproc // per_gpu > gpus:
        return (f"{nproc} ranks at {per_gpu} per GPU need {nproc // per_gpu} GPUs; this node "
                f"has {gpus}")
    return None


def rank_environment(directory: str, per_gpu: int) -> dict[str, str]:
    """What each rank gets in its environment: the daemon's directories, its SM share and N."""
    return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(directory, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(directory, "log"),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm_percentage(per_gpu)),
            RANKS_PER_GPU_ENV: str(per_gpu)}


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class MpsError(RuntimeError):
    """The control daemon could not be started (or the control program is missing)."""


class MpsDaemon:
    """A private MPS control daemon for the life of a `with` block: started on entry, told to
    quit and its directory removed on exit, however the block ends."""

    def __init__(self, per_gpu: int):
        self.per_gpu = per_gpu
        self.directory: Optional[str] = None
        self.environment: dict[str, str] = {}

    def __enter__(self) -> "MpsDaemon":
        if shutil.which(MPS_CONTROL) is None:
            raise MpsError(f"{MPS_CONTROL} is not on PATH (NVIDIA's MPS, which several ranks on "
                           f"one GPU need)")
        # Under /tmp, short: the daemon's socket path must stay under 108 characters.
        self.directory = tempfile.mkdtemp(prefix="dpp_mps.", dir="/tmp")
        self.environment = rank_environment(self.directory, self.per_gpu)
        for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            os.mkdir(self.environment[name])
        try:
            self._control(["-d"], None, "start the daemon")
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *_exc) -> None:
        try:
            pid = self._daemon_pid()
            self._control([], "quit\n", "stop the daemon")
            if pid is not None:
                self._wait_for_exit(pid)
        except MpsError as error:  # the job's own outcome stands; say why the daemon may linger
            print(f"megatron_dpp: warning: {error}", flush=True)
        finally:
            self._remove()

    def _daemon_pid(self) -> Optional[int]:
        """The control daemon's process id from its pid file in the pipe directory (None where
        it wrote none)."""
        path = os.path.join(self.environment["CUDA_MPS_PIPE_DIRECTORY"], PID_FILE)
        try:
            with open(path) as file:
                return int(file.read().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _wait_for_exit(pid: int) -> None:
        """`quit` returns before the daemon (and its server) has gone; the next job's daemon on the
        same GPU must not meet this one, so wait for it, at most QUIT_TIMEOUT_S."""
        deadline = time.monotonic() + QUIT_TIMEOUT_S
        while time.monotonic() < deadline:
            if not _running(pid):
                return
            time.sleep(0.05)
        raise MpsError(f"the MPS control daemon (pid {pid}) was still running "
                       f"{QUIT_TIMEOUT_S:.0f} s after quit")

    def _control(self, args: list[str], stdin: Optional[str], what: str) -> None:
        env = {**os.environ, **self.environment}
        try:
            done = subprocess.run([MPS_CONTROL, *args], input=stdin, env=env, text=True,
                                  capture_output=True, timeout=CONTROL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise MpsError(f"{MPS_CONTROL} {' '.join(args)}: did not {what} within "
                           f"{CONTROL_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            raise MpsError(f"{MPS_CONTROL} {' '.join(args)} could not {what} (exit status "
                           f"{done.returncode}{': ' + detail[-1] if detail else ''})")

    def _remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def banner(self, nproc: int) -> str:
        """The launcher's line on what it did."""
        gpus = nproc // self.per_gpu
        return (f"ranks per GPU: {self.per_gpu} (rank r on GPU r // {self.per_gpu}: {nproc} ranks "
                f"on {gpus} GPU{'s' if gpus != 1 else ''}); MPS control daemon started "
                f"(CUDA_MPS_PIPE_DIRECTORY={self.environment['CUDA_MPS_PIPE_DIRECTORY']}), "
                f"{sm_percentage(self.per_gpu)}% of the SMs per rank "
                f"(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); collectives over gloo (NCCL refuses two "
                f"ranks on one device), CUDA tensors staged through the host where gloo lacks "
                f"the operation")


CHILD_STOP_TIMEOUT_S = 10.0
"""How long a command stopped by a signal has to end before it is killed."""


class Stopped(BaseException):
    """SIGINT/SIGTERM to a process holding the daemon (the launcher, run_under_daemon), raised by
    raise_stopped: unwinds its `with` blocks, so that the daemon is stopped."""

    def __init__(self, number: int):
        super().__init__(number)
        self.number = number


def raise_stopped(number, _frame):
    raise Stopped(number)


def run_under_daemon(per_gpu: int, command: list[str]) -> int:
    """COMMAND with a private daemon's environment (as the launcher gives its ranks); its exit
    status, 128 + N when SIGINT/SIGTERM (signal N) stopped it. The daemon is stopped either way."""
    import signal
    import sys

    previous = {number: signal.signal(number, raise_stopped)
                for number in (signal.SIGINT, signal.SIGTERM)}
    child = None
    try:
        with MpsDaemon(per_gpu) as daemon:
            try:
                child = subprocess.Popen(command, env={**os.environ, **daemon.environment})
                return child.wait()  # bounded by whoever runs us (gpu_check.sh's step timeout)
            except Stopped as stop:
                if child is not None and child.poll() is None:
                    child.send_signal(stop.number)
                    try:
                        child.wait(timeout=CHILD_STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait(timeout=CHILD_STOP_TIMEOUT_S)
                return 128 + stop.number
    except MpsError as error:
        print(f"megatron_dpp.shared_gpu: error: {error}", file=sys.stderr, flush=True)
        return 2
    except Stopped as stop:  # while the daemon started or stopped
        return 128 + stop.number
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m megatron_dpp.shared_gpu --ranks-per-gpu N -- COMMAND...`: COMMAND under a
    private MPS daemon (gpu_check.sh's transport check), each of its processes with 100 // N
    percent of the SMs."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m megatron_dpp.shared_gpu",
                                     description=main.__doc__)
    parser.add_argument("--ranks-per-gpu", type=int, required=True, metavar="N",
                        help="the processes that share the GPU (their SM share: 100 // N)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.ranks_per_gpu < 1 or not command:
        parser.error("expected --ranks-per-gpu N (N >= 1) and -- COMMAND...")
    return run_under_daemon(args.ranks_per_gpu, command)


if __name__ == "__main__":
    raise SystemExit(main())
