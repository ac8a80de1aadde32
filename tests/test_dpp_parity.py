"""DPP vs Megatron's schedule: the same tiny GPT, the same data, 10 iterations, fp32 on CPU.

Each layout trains once under Megatron's own schedule (1F1B, or interleaved 1F1B with virtual
stages) and once with --use-dpp (policy dpp:adaptive, which reorders microbatches when their sizes
differ); lm loss and grad norm must agree within 1e-5 relative at every iteration.

To keep the suite short, layouts whose Megatron runs compute the same thing share one Megatron
run: pp=2, pp=4, pp=2 x vpp=2 and dp=2 x pp=2 split the same 4-layer model and the same global
batch, and Megatron gives equal losses for them (tests/test_train_parity.py checks that within
1e-5); they are compared with Megatron's pp=2 1F1B, and so are three uneven splits of those 4
layers (one of them a layout string). pp=4 x vpp=2 (8 layers, and an uneven pp=2 x vpp=2 split of
them), tp=2 x pp=2 (other reduction order) and variable-length data each have their own Megatron
run.

On GPUs (marked `gpu(N)`, skipped with fewer than the layout's N processes): the same comparison
with one rank per GPU, NCCL for Megatron's P2P and shm_tensor's CUDA IPC for DPP's.
"""
import pytest

from _gpu import gpu_env
from _train_util import run_training

ITERATIONS = 10
REL_TOL = 1e-5
DPP = ["--use-dpp", "--dpp-timeout", "60", "--p2p-transport", "shm"]
COMMON = ["--train-iters", str(ITERATIONS)]

PP2 = ["--pipeline-model-parallel-size", "2"]
PP4 = ["--pipeline-model-parallel-size", "4"]
EIGHT_LAYERS = ["--num-layers", "8"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
V = VPP2 + ["--dpp-stage-placement", "v"]  # ZB-V's placement: stages 0..P-1 down, P..2P-1 back

# name -> (Megatron reference run, DPP layout flags, processes)
REFERENCES = {
    "pp2": (PP2, 2),
    "pp4_vpp2": (PP4 + EIGHT_LAYERS + VPP2, 4),
    "tp2_pp2": (PP2 + ["--tensor-model-parallel-size", "2"], 4),
    "varlen_pp2": (PP2 + ["--variable-seq-lengths"], 2),
}
LAYOUTS = {
    "pp2": ("pp2", PP2, 2),
    "pp4": ("pp2", PP4, 4),
    "pp2_vpp2": ("pp2", PP2 + VPP2, 2),
    "dp2_pp2": ("pp2", PP2, 4),
    "dp2_pp2_overlap_grad_reduce": ("pp2", PP2 + ["--overlap-grad-reduce"], 4),
    # Received activations and gradients in lent slots (the test model's 16 KiB are below the default).
    "pp2_vpp2_lent_slots": ("pp2", PP2 + VPP2 + ["--shm-zero-copy-min-kb", "1"], 2),
    "pp4_vpp2": ("pp4_vpp2", PP4 + EIGHT_LAYERS + VPP2, 4),
    "tp2_pp2": ("tp2_pp2", REFERENCES["tp2_pp2"][0], 4),
    "varlen_pp2": ("varlen_pp2", REFERENCES["varlen_pp2"][0], 2),
    # Uneven splits (parallel/split.py): layers 1 | 3; 1 | 2 | 1 with the embedding and the
    # loss counted as layers; 1+1 | 3+3 of 8 layers over virtual stages.
    "pp2_uneven": ("pp2", PP2 + ["--decoder-first-pipeline-num-layers", "1"], 2),
    # A layout string: 2+1 | 1+0 over virtual stages, the last rank's second chunk only the loss.
    "pp2_layout_with_an_empty_chunk": ("pp2", PP2 + ["--pipeline-model-parallel-layout",
                                                     "Ett|t|t|L"], 2),
    "pp3_embedding_and_loss_counted": (
        "pp2", ["--pipeline-model-parallel-size", "3", "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split"], 3),
    "pp2_vpp2_uneven": ("pp4_vpp2", PP2 + EIGHT_LAYERS + VPP2
                        + ["--decoder-last-pipeline-num-layers", "6"], 2),
    # The v placement: rank 0 holds the embedding and the loss, the tied embedding's copies are
    # summed there; the same model as the interleaved layouts, so the same references.
    "pp2_v": ("pp2", PP2 + V, 2),
    "pp2_v_zbv": ("pp2", PP2 + V + ["--dpp-policy", "zb-v"], 2),
    "pp4_v": ("pp4_vpp2", PP4 + EIGHT_LAYERS + V, 4),
    "dp2_pp2_v": ("pp2", PP2 + V, 4),
    "tp2_pp2_v": ("tp2_pp2", REFERENCES["tp2_pp2"][0] + V, 4),
    # Et|tt|t|L on the v: stage 2 (layer 4) on rank 1, stage 3 (the loss alone) on rank 0.
    "pp2_v_layout": ("pp2", PP2 + ["--pipeline-model-parallel-layout", "Et|tt|t|L",
                                   "--dpp-stage-placement", "v"], 2),
}

_reference_cache = {}


def megatron_reference(name, on_gpus=False):
    if (name, on_gpus) not in _reference_cache:
        flags, nproc = REFERENCES[name]
        # Megatron's own schedule and P2P (torch.distributed), not our transports.
        rc, losses, grad_norms, out = run_training(COMMON + flags + ["--p2p-transport", "torch"],
                                                   nproc=nproc, timeout=240,
                                                   env=gpu_env() if on_gpus else None)
        assert rc == 0, out[-3000:]
        assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
        _reference_cache[(name, on_gpus)] = (losses, grad_norms)
    return _reference_cache[(name, on_gpus)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dpp_matches_megatron(layout):
    reference_name, flags, nproc = LAYOUTS[layout]
    ref_losses, ref_grad_norms = megatron_reference(reference_name)
    rc, losses, grad_norms, out = run_training(COMMON + DPP + flags, nproc=nproc, timeout=240)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
    assert losses == pytest.approx(ref_losses, rel=REL_TOL), (layout, losses, ref_losses)
    assert grad_norms == pytest.approx(ref_grad_norms, rel=REL_TOL), (layout, grad_norms, ref_grad_norms)


# GPU kernels (cuBLAS split-K, atomics in embedding backward) need not add in one fixed order.
GPU_REL_TOL = 1e-4
GPU_LAYOUTS = ["pp2", "pp2_vpp2", "dp2_pp2", "pp4", "pp2_v"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.gpu(LAYOUTS[name][2]))
                                    for name in GPU_LAYOUTS])
def test_dpp_matches_megatron_on_gpus(layout):
    reference_name, flags, nproc = LAYOUTS[layout]
    ref_losses, ref_grad_norms = megatron_reference(reference_name, on_gpus=True)
    rc, losses, grad_norms, out = run_training(COMMON + DPP + flags, nproc=nproc, timeout=240,
                                               env=gpu_env())
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
    assert losses == pytest.approx(ref_losses, rel=GPU_REL_TOL), (layout, losses, ref_losses)
    assert grad_norms == pytest.approx(ref_grad_norms, rel=GPU_REL_TOL), (layout, grad_norms,
                                                                          ref_grad_norms)
