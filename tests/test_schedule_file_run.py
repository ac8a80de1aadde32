"""--dpp-schedule FILE: the runtime runs a schedule in torch's CSV action format, and a traced run's
executed order (profiling/aggregate.py --order-csv) is such a file.

- torch's own ScheduleZBVZeroBubble order (its _dump_csv) trains the tiny GPT on the v placement
  with split backwards, with Megatron's 1F1B losses (1e-5 relative);
- a traced dpp:adaptive run's executed order, dumped and run again, runs as listed: its own dump
  is the same file, and the losses are the first run's (1e-5 relative);
- a file that does not fit the run is one line before launch (tests/test_args_validation.py's
  BAD_FLAGS `dpp_schedule_*`)."""
import subprocess
from pathlib import Path

import pytest

from _train_util import PYTHON, REPO_ROOT, run_training
from test_dpp_parity import COMMON, DPP, ITERATIONS, REL_TOL, megatron_reference
from test_schedule_csv import _torch_zbv_csv

V_SPLIT = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
           "--dpp-stage-placement", "v", "--dpp-split-backward"]
AGGREGATE = str(REPO_ROOT / "profiling" / "aggregate.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchs_zbv_schedule_file_trains_with_megatrons_losses(tmp_path):
    path = tmp_path / "zbv.csv"
    _torch_zbv_csv(str(path), 2, 8)  # P=2, M=8: the tiny GPT's global batch of 8
    ref_losses, ref_norms = megatron_reference("pp2")
    rc, losses, norms, out = run_training(COMMON + DPP + V_SPLIT + ["--dpp-schedule", str(path)],
                                          nproc=2, timeout=240)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS, out[-3000:]
    assert losses == pytest.approx(ref_losses, rel=REL_TOL)
    assert norms == pytest.approx(ref_norms, rel=REL_TOL)


def _traced(tmp_path: Path, name: str, flags: list) -> tuple[list, Path]:
    rc, losses, _norms, out = run_training(
        ["--train-iters", "3", "--variable-seq-lengths", *DPP, *flags, "--trace", "--trace-dir",
         str(tmp_path / name)], nproc=2, timeout=240)
    assert rc == 0, out[-3000:]
    (run_dir,) = (tmp_path / name).iterdir()
    result = subprocess.run([PYTHON, AGGREGATE, "--benchmark_dir", str(run_dir), "--iterations",
                             "1:2", "--order-csv"], capture_output=True, text=True, timeout=300,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    (order,) = run_dir.glob("*-order-iteration1.csv")
    return losses, order


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dumped_executed_order_runs_again_as_listed(tmp_path):
    flags = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
             "--dpp-stage-placement", "v", "--dpp-split-backward"]
    losses, order = _traced(tmp_path, "adaptive", flags)
    text = order.read_text()
    assert "I" in text and "W" in text  # split backwards, as torch writes them
    again, again_order = _traced(tmp_path, "replayed", flags + ["--dpp-schedule", str(order)])
    assert again_order.read_text() == text
    # Every iteration runs the file; the first run ordered its other iterations otherwise, and
    # weight gradients summed in another order differ in the last bits.
    assert again == pytest.approx(losses, rel=REL_TOL)
