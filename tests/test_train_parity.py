"""Loss parity across parallel layouts: every layout trains the same tiny GPT on the same data.

The pp=1 run is the reference (once per module); pp=2, pp=4, vpp=2 (pp=2), pp=2 split 3 | 1
(--decoder-last-pipeline-num-layers), tp=2 and dp=2 must give the same lm loss for 5 iterations
within 1e-5 relative (fp32; init is layout-independent).
"""
import pytest

from _train_util import run_training

ITERATIONS = 5
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def reference_losses():
    rc, losses, grad_norms, out = run_training([], nproc=1, timeout=240)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
    return losses


LAYOUTS = {
    "pp2": (["--pipeline-model-parallel-size", "2"], 2),
    "pp4": (["--pipeline-model-parallel-size", "4"], 4),
    "vpp2_pp2": (["--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "pp2_uneven": (["--pipeline-model-parallel-size", "2",
                    "--decoder-last-pipeline-num-layers", "3"], 2),
    "tp2": (["--tensor-model-parallel-size", "2"], 2),
    "dp2": ([], 2),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_matches_single_stage(layout, reference_losses):
    extra, nproc = LAYOUTS[layout]
    rc, losses, _grad_norms, out = run_training(extra, nproc=nproc, timeout=240)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS, out[-3000:]
    assert losses == pytest.approx(reference_losses, rel=REL_TOL), (layout, losses,
                                                                     reference_losses)


@pytest.mark.timeout(300)
def test_reference_loss_falls(reference_losses):
    assert reference_losses[-1] < reference_losses[0]
