"""--dpp-split-backward vs Megatron's schedule: the tiny GPT (fp32, CPU), 10 iterations.

The same comparison as test_dpp_parity.py (its layouts, its Megatron reference runs, 1e-5 relative
on lm loss and grad norm at every iteration), with every backward split into B and W
(DeferredGPTModel's layers under the runtime's stash), and pp=2 with full activation recompute.
The pp=2 run is traced: W tasks appear as
`W<m>.<c>` in category weight-grad, each after its B, and the activation-bytes counter (the
scheduler's held bytes, the stash's measured bytes) stays within the budget.
"""
import json
from pathlib import Path

import pytest

from _train_util import run_training
from test_dpp_parity import COMMON, DPP, ITERATIONS, LAYOUTS, REL_TOL, megatron_reference

SPLIT = DPP + ["--dpp-split-backward"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
# Full recompute reruns each layer's forward inside B, under the same deferral key; Megatron's
# numbers do not change with recompute, so pp2's reference serves.
SPLIT_ONLY_LAYOUTS = {"pp2_recompute_full": ("pp2", LAYOUTS["pp2"][1] + RECOMPUTE, 2)}
SPLIT_LAYOUTS = ["pp2", "pp4", "pp2_vpp2", "dp2_pp2", "dp2_pp2_overlap_grad_reduce", "tp2_pp2",
                 "varlen_pp2", "pp4_vpp2", "pp2_v", "pp2_v_zbv", "pp4_v", "dp2_pp2_v", "tp2_pp2_v",
                 *SPLIT_ONLY_LAYOUTS]


def _check_trace(trace_dir: Path) -> None:
    files = sorted(trace_dir.rglob("benchmark-rank*.json"))
    assert len(files) == 2, files
    for path in files:
        events = json.loads(path.read_text())["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in
                 ("forward", "backward", "weight-grad")]
        weight_grads = [e for e in spans if e["cat"] == "weight-grad"]
        assert weight_grads and all(e["name"].startswith("W") for e in weight_grads)
        assert len(weight_grads) == len([e for e in spans if e["cat"] == "backward"])
        ended = {}
        for event in spans:  # per iteration, a W starts after its B ended
            key = (event["args"]["iteration"], event["name"][1:])
            if event["cat"] == "backward":
                ended[key] = event["ts"] + event["dur"]
            elif event["cat"] == "weight-grad":
                assert event["ts"] >= ended[key], (path.name, event)
        memory = [e["args"] for e in events if e.get("ph") == "C" and e["name"] == "activation bytes"]
        assert memory and all(0 <= m["held"] <= m["budget"] for m in memory)
        assert all(0 <= m["stash"] <= m["held"] for m in memory)
        assert max(m["stash"] for m in memory) > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
def test_split_backward_matches_megatron(layout, tmp_path):
    reference_name, flags, nproc = {**LAYOUTS, **SPLIT_ONLY_LAYOUTS}[layout]
    ref_losses, ref_grad_norms = megatron_reference(reference_name)
    traced = ["--trace", "--trace-dir", str(tmp_path)] if layout == "pp2" else []
    rc, losses, grad_norms, out = run_training(COMMON + SPLIT + flags + traced, nproc=nproc,
                                               timeout=300)
    assert rc == 0, out[-3000:]
    assert len(losses) == ITERATIONS and len(grad_norms) == ITERATIONS, out[-3000:]
    assert losses == pytest.approx(ref_losses, rel=REL_TOL), (layout, losses, ref_losses)
    assert grad_norms == pytest.approx(ref_grad_norms, rel=REL_TOL), (layout, grad_norms, ref_grad_norms)
    worst = max(max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                max(abs(a - b) / abs(b) for a, b in zip(grad_norms, ref_grad_norms)))
    print(f"{layout}: largest relative difference {worst:.2e}")
    if traced:
        _check_trace(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_split_backward_resumed_from_a_checkpoint_stays_on_megatrons_trajectory(tmp_path):
    """Five iterations with the split, saved; then resumed to ten: every iteration's lm loss and
    grad norm equal Megatron's uninterrupted ten (the LR schedule fixed to ten iterations in both)."""
    ref_losses, ref_grad_norms = megatron_reference("pp2")
    flags = LAYOUTS["pp2"][1]
    save = str(tmp_path / "ckpt")
    half = ITERATIONS // 2
    rc, first, first_norms, out = run_training(
        ["--train-iters", str(half), "--lr-decay-iters", str(ITERATIONS), "--save", save, *SPLIT,
         *flags], nproc=2, timeout=300)
    assert rc == 0, out[-3000:]
    rc, resumed, resumed_norms, out = run_training(
        [*COMMON, "--lr-decay-iters", str(ITERATIONS), "--load", save, *SPLIT, *flags], nproc=2,
        timeout=300)
    assert rc == 0, out[-3000:]
    assert "loaded checkpoint" in out, out[-3000:]
    assert first + resumed == pytest.approx(ref_losses, rel=REL_TOL), (first, resumed, ref_losses)
    assert first_norms + resumed_norms == pytest.approx(ref_grad_norms, rel=REL_TOL)
