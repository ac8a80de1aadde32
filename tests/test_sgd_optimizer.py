"""--optimizer sgd (Megatron-LM's, with --sgd-momentum): trains, the dynamic schedule matches
Megatron's, and a checkpoint in either format resumes the uninterrupted run (Megatron-Core gives
SGD no state initializer, which its torch_dist load needs: mcore/sgd_state.py); its zero
momentum buffers change no step."""
import tempfile

import pytest
import torch

from _train_util import run_training
from megatron_dpp.mcore.sgd_state import init_sgd_momentum

SGD = ["--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005"]


def test_zero_momentum_buffers_change_no_step():
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    grads = [torch.randn(5, 3) for _ in range(2)]
    results = []
    for init in (False, True):
        params = [torch.nn.Parameter(w.detach().clone()) for w in weights]
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
        if init:
            init_sgd_momentum(optimizer)
            assert all(torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros(5, 3))
                       for p in params)
        for _ in range(3):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()
        results.append([p.detach() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    without_momentum = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    init_sgd_momentum(without_momentum)
    assert not without_momentum.state  # torch's SGD keeps no state without momentum


@pytest.mark.timeout(400)
def test_sgd_trains_and_the_dynamic_schedule_matches_megatrons():
    flags = [*SGD, "--train-iters", "4", "--pipeline-model-parallel-size", "2"]
    rc, megatron, _n, out = run_training([*flags, "--adam-beta2", "0.95"], nproc=2)
    assert rc == 0 and len(megatron) == 4, out[-3000:]
    assert "kernels: fused optimizer off: torch SGD" in out
    # A recipe's Adam flags do not stop an SGD run; one line says they go unused.
    assert " --adam-beta2: Adam's, unused by --optimizer sgd" in out
    assert megatron[-1] < megatron[0]
    rc, dpp, _n, out = run_training([*flags, "--use-dpp"], nproc=2)
    assert rc == 0, out[-3000:]
    assert dpp == pytest.approx(megatron, rel=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra", [[], ["--bf16"], ["--ckpt-format", "torch"],
                                   ["--sgd-momentum", "0"]],
                         ids=["torch_dist", "torch_dist-bf16", "torch", "no-momentum"])
def test_a_checkpoint_resumes_the_uninterrupted_run(extra):
    flags = [*SGD, "--train-iters", "4", *extra]
    rc, whole, _n, out = run_training(flags, nproc=2)
    assert rc == 0 and len(whole) == 4, out[-3000:]
    with tempfile.TemporaryDirectory() as save:
        rc, first, _n, out = run_training([*flags, "--save", save, "--exit-interval", "2"],
                                          nproc=2)
        assert rc == 0 and len(first) == 2, out[-3000:]
        rc, rest, _n, out = run_training([*flags, "--load", save], nproc=2)
        assert rc == 0, out[-3000:]
    assert first + rest == whole  # bit for bit on CPU
