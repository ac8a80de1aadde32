"""Llama (`python -m megatron_dpp.pretrain --model llama`, grouped-query attention) on the GPT sample
data: --use-dpp equals Megatron's own schedule (1F1B, interleaved 1F1B with virtual stages) within
1e-5 relative in lm loss and grad norm at every iteration, at pp=2, pp=2 x vpp=2, tp=2 x pp=2 and
pp=2 with the split backward (--dpp-split-backward: deferred weight gradients, RMSNorm's
included), and on the v placement (--dpp-stage-placement v) at pp=2 (fused, split, zb-v),
tp=2 x pp=2 and pp=4, fp32 on CPU.

As in tests/test_dpp_parity.py, pp=2 and pp=2 x vpp=2 split the same 4-layer model and Megatron
gives them equal losses, so they share one Megatron 1F1B run; tp=2 x pp=2 has its own."""
import pytest

from _train_util import TINY_GPT_ARGS, run_training

ITERATIONS = 3
REL_TOL = 1e-5
ENTRY = "megatron_dpp.pretrain"
# GPT's tiny run with Llama's model: 4 heads in 2 key/value groups, SwiGLU 128 wide.
TINY_LLAMA_ARGS = [*TINY_GPT_ARGS, "--model", "llama", "--num-query-groups", "2",
                   "--ffn-hidden-size", "128", "--train-iters", str(ITERATIONS)]
DPP = ["--use-dpp", "--dpp-timeout", "60", "--p2p-transport", "shm"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2_PP2 = PP2 + ["--tensor-model-parallel-size", "2"]
VPP2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
V = VPP2 + ["--dpp-stage-placement", "v"]  # ZB-V's placement (Llama's embeddings are untied)
EIGHT_LAYERS = ["--num-layers", "8"]

# name -> (Megatron reference, DPP flags, processes)
REFERENCES = {"pp2": (PP2, 2), "tp2_pp2": (TP2_PP2, 4), "pp2_8_layers": (PP2 + EIGHT_LAYERS, 2)}
LAYOUTS = {
    "pp2": ("pp2", PP2, 2),
    "pp2_vpp2": ("pp2", PP2 + VPP2, 2),
    # SwiGLU's fc1 is split over tp with partition stride 2 (gate and up shards).
    "tp2_pp2": ("tp2_pp2", TP2_PP2, 4),
    "pp2_split_backward": ("pp2", PP2 + ["--dpp-split-backward"], 2),
    "pp2_v": ("pp2", PP2 + V, 2),
    "pp2_v_split_backward": ("pp2", PP2 + V + ["--dpp-split-backward"], 2),
    "pp2_v_zbv_split_backward": ("pp2", PP2 + V + ["--dpp-policy", "zb-v",
                                                   "--dpp-split-backward"], 2),
    "tp2_pp2_v": ("tp2_pp2", TP2_PP2 + V, 4),
    "pp4_v": ("pp2_8_layers", ["--pipeline-model-parallel-size", "4"] + EIGHT_LAYERS + V, 4),
}

_reference_cache = {}


def _train(flags, nproc):
    rc, losses, grad_norms, out = run_training(flags, nproc=nproc, timeout=200,
                                               base_args=TINY_LLAMA_ARGS, entry=ENTRY)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
    return losses, grad_norms


def megatron_reference(name):
    if name not in _reference_cache:
        flags, nproc = REFERENCES[name]
        # Megatron's own schedule and P2P (torch.distributed).
        _reference_cache[name] = _train(flags + ["--p2p-transport", "torch"], nproc)
    return _reference_cache[name]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("reference_name, flags, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_llama_dpp_matches_megatron(reference_name, flags, nproc):
    layout = flags
    ref_losses, ref_grad_norms = megatron_reference(reference_name)
    losses, grad_norms = _train(DPP + flags, nproc)
    assert losses == pytest.approx(ref_losses, rel=REL_TOL), (layout, losses, ref_losses)
    assert grad_norms == pytest.approx(ref_grad_norms, rel=REL_TOL), (layout, grad_norms,
                                                                      ref_grad_norms)
