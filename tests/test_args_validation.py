"""Each bad flag: one line on stderr that names the problem, exit code 2, before any process group.

The processes run without torchrun and without MASTER_ADDR: had validation come after creating a
process group, they would fail differently (or wait), not exit 2 with the line we expect.
"""
import os
import subprocess

import pytest

from _train_util import PYTHON, REPO_ROOT, data_args

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "1e-3"]


def run_validation(args, world_size=1, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world_size), RANK="0")
    for name in ("MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    return subprocess.run([PYTHON, "-m", "megatron_dpp.pretrain_gpt", *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


BAD_FLAGS = {
    "layers_vs_pipeline": (["--pipeline-model-parallel-size", "4", "--num-layers", "6"], 4,
                           "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4"),
    "layers_vs_virtual_stages": (["--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "3"], 2,
                                 "layers per virtual stage (3)"),
    "global_batch_vs_micro_batch_x_dp": (["--global-batch-size", "6", "--micro-batch-size", "4"],
                                         1, "--global-batch-size 6 is not divisible by "
                                            "--micro-batch-size 4 x data-parallel size 1"),
    "global_batch_vs_dp": (["--global-batch-size", "3"], 2,
                           "--global-batch-size 3 is not divisible by --micro-batch-size 1 x "
                           "data-parallel size 2"),
    "world_size_vs_parallel_sizes": (["--pipeline-model-parallel-size", "2",
                                      "--tensor-model-parallel-size", "2"], 6,
                                     "world size 6 is not a multiple of tensor (2) x pipeline (2)"),
    "bf16_on_cpu": (["--bf16"], 1, "--bf16 needs a CUDA GPU"),
    "fp16_on_cpu": (["--fp16"], 1, "--fp16 needs a CUDA GPU"),
    "flash_attn_on_cpu": (["--use-flash-attn"], 1, "--use-flash-attn needs a CUDA GPU"),
    "nccl_on_cpu": (["--distributed-backend", "nccl"], 1, "--distributed-backend nccl needs CUDA"),
    "distributed_optimizer_on_cpu": (["--use-distributed-optimizer"], 1,
                                     "--use-distributed-optimizer needs CUDA GPUs"),
    "sequence_parallel_without_te": (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                     2, "--sequence-parallel needs Transformer Engine"),
    "missing_data_files": (["--data-path", "/nonexistent/corpus_text_document"], 1,
                           "/nonexistent/corpus_text_document.bin and "
                           "/nonexistent/corpus_text_document.idx not found"),
    "missing_vocab_file": (["--vocab-file", "/nonexistent/vocab.json"], 1,
                           "--vocab-file /nonexistent/vocab.json not found"),
    "unknown_flag": (["--no-such-flag"], 1, "unrecognized arguments: --no-such-flag"),
    "shm_zero_copy_negative": (["--p2p-transport", "shm", "--shm-zero-copy-min-kb", "-1"], 1,
                               "--shm-zero-copy-min-kb must be >= 0"),
    "trace_without_pipeline": (["--trace"], 1,
                               "--trace records a pipeline schedule; set "
                               "--pipeline-model-parallel-size 2 or more"),
    "profile_window_empty": (["--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
                              "--profile-step-end", "3"], 1,
                             "--profile-step-start 3 must be >= 0 and below --profile-step-end 3"),
    "profile_window_past_training": (["--profile", "--use-pytorch-profiler"], 1,
                                     "--profile-step-end 12 is past --train-iters 5"),
    "profile_rank_outside_world": (["--profile", "--use-pytorch-profiler", "--profile-step-start",
                                    "1", "--profile-step-end", "3", "--profile-ranks", "0", "2"], 2,
                                   "--profile-ranks 2: not a rank of a world of 2 (0..1)"),
    "profile_flags_without_profile": (["--profile-ranks", "1"], 1,
                                      "--profile-ranks need --profile"),
    "pytorch_profiler_without_profile": (["--use-pytorch-profiler"], 1,
                                         "--use-pytorch-profiler need --profile"),
    "profile_nsys_on_cpu": (["--profile", "--profile-step-start", "1", "--profile-step-end", "3"],
                            1, "--profile opens an nsys capture range (cudaProfilerStart/Stop), "
                               "which needs a CUDA GPU and there is none here; add "
                               "--use-pytorch-profiler for torch.profiler"),
    "nvtx_on_cpu": (["--nvtx"], 1, "--nvtx annotates CUDA work"),
    "split_backward_without_use_dpp": (["--pipeline-model-parallel-size", "2",
                                        "--dpp-split-backward"], 2,
                                       "--dpp-split-backward splits the backward of the DPP "
                                       "runtime; add --use-dpp"),
    "trace_dir_under_a_file": (["--pipeline-model-parallel-size", "2", "--trace", "--trace-dir",
                                "/dev/null/traces"], 2,
                               "--trace-dir /dev/null/traces: cannot create it in /dev/null"),
    "shm_too_many_slots": (["--p2p-transport", "shm", "--shm-num-slots", "65"], 1,
                           "--shm-num-slots: ShmConfig.num_slots=65: must be 1..64"),
    "node_ips_without_multi_node": (["--node-ips", "10.0.0.1"], 1,
                                    "--node-ips needs --multi-node"),
    "multi_node_without_node_ips": (["--multi-node"], 1, "--multi-node needs --node-ips"),
    "node_ips_malformed": (["--multi-node", "--node-ips", "10.0.0.1,10.0.0"], 1,
                           "--node-ips 10.0.0.1,10.0.0: '10.0.0' is not an IPv4 or IPv6 address"),
    "node_ips_empty_entry": (["--multi-node", "--node-ips", "10.0.0.1,,10.0.0.2"], 1,
                             "entry 2 of '10.0.0.1,,10.0.0.2' is empty"),
    "node_ips_duplicate": (["--multi-node", "--node-ips", "10.0.0.1,10.0.0.1"], 1,
                           "10.0.0.1 is listed twice"),
    # Outside torchrun nothing says how many nodes the job has (tests/test_launch_multinode.py
    # checks the count with GROUP_WORLD_SIZE set).
    "multi_node_without_node_count": (["--multi-node", "--node-ips", "10.0.0.1"], 1,
                                      "--multi-node: GROUP_WORLD_SIZE (the number of nodes) is "
                                      "not set"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_is_one_line_exit_2(case):
    if case in ("bf16_on_cpu", "fp16_on_cpu", "flash_attn_on_cpu", "nccl_on_cpu",
                "distributed_optimizer_on_cpu", "sequence_parallel_without_te", "nvtx_on_cpu",
                "profile_nsys_on_cpu"):
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("GPU-only flags are valid on this machine")
    extra, world_size, expected = BAD_FLAGS[case]
    result = run_validation([*data_args(), *TINY, *extra], world_size=world_size)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("megatron_dpp.pretrain_gpt: error: "), lines[0]
    assert expected in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("extra", [[], ["--trace"], ["--profile", "--use-pytorch-profiler",
                                                      "--profile-step-start", "2",
                                                      "--profile-step-end", "4", "--profile-ranks",
                                                      "0", "1"]],
                         ids=["plain", "trace_without_dpp", "profile"])
def test_good_flags_pass_validation(extra):
    """The same base flags validate cleanly (so each bad case fails for its own reason); --trace
    without --use-dpp records Megatron's own schedule."""
    result = subprocess.run(
        [PYTHON, "-m", "megatron_dpp.arguments", *data_args(), *TINY,
         "--pipeline-model-parallel-size", "2", *extra],
        env=dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2"), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
