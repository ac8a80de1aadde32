"""Each bad flag: one line on stderr that names the problem, exit code 2, before any process group.

The table runs in this process (parse_args as the entry point calls it, the environment as
torchrun would set it, without MASTER_ADDR: had validation come after creating a process group, it
would fail differently or wait, not exit 2); a few cases also run as real processes
(test_bad_flag_in_a_process), which shows that nothing else reaches stderr there.
"""
import os
import subprocess

import pytest

from _train_util import PYTHON, REPO_ROOT, data_args

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "1e-3"]


# An existing file where a directory is expected; an address no machine here has (TEST-NET-3).
A_FILE = str(REPO_ROOT / "pyproject.toml")
FOREIGN = "203.0.113.7"


def run_validation(args, world_size=1, timeout=60, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world_size), RANK="0")
    for name in ("MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    env.update(env_extra or {})
    return subprocess.run([PYTHON, "-m", "megatron_dpp.pretrain_gpt", *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


BAD_FLAGS = {
    "dataloader_type_cyclic": (["--dataloader-type", "cyclic"], 1,
                               "--dataloader-type cyclic (Megatron-LM's "
                               "MegatronPretrainingRandomSampler"),
    "dataloader_type_external": (["--dataloader-type", "external"], 1,
                                 "--dataloader-type external (the training script's own iterator"),
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
    "flash_attn_on_cpu": (["--use-flash-attn"], 1, "--use-flash-attn needs a CUDA GPU"),
    "nccl_on_cpu": (["--distributed-backend", "nccl"], 1, "--distributed-backend nccl needs CUDA"),
    "sequence_parallel_without_te": (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                     2, "--sequence-parallel needs Transformer Engine"),
    "missing_data_files": (["--data-path", "/nonexistent/corpus_text_document"], 1,
                           "/nonexistent/corpus_text_document.bin and "
                           "/nonexistent/corpus_text_document.idx not found"),
    "missing_vocab_file": (["--vocab-file", "/nonexistent/vocab.json"], 1,
                           "--vocab-file '/nonexistent/vocab.json' does not exist"),
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
    "placement_v_without_use_dpp": (["--pipeline-model-parallel-size", "2",
                                     "--num-virtual-stages-per-pipeline-rank", "2",
                                     "--dpp-stage-placement", "v"], 2,
                                    "--dpp-stage-placement v is run by the DPP runtime"),
    "placement_v_one_chunk": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                               "--dpp-stage-placement", "v"], 2,
                              "--dpp-stage-placement v holds two model chunks per rank, got 1; "
                              "add --num-virtual-stages-per-pipeline-rank 2"),
    "placement_v_megatron_order": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                    "--num-virtual-stages-per-pipeline-rank", "2",
                                    "--dpp-stage-placement", "v", "--dpp-policy",
                                    "interleaved-1f1b"], 2,
                                   "--dpp-policy interleaved-1f1b is Megatron's order for the "
                                   "interleaved placement, got placement v:2"),
    "placement_zbv_interleaved": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                   "--num-virtual-stages-per-pipeline-rank", "2",
                                   "--dpp-policy", "zb-v"], 2,
                                  "--dpp-policy zb-v is ZB-V's order for the v placement"),
    "placement_v_overlap_tied": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                  "--num-virtual-stages-per-pipeline-rank", "2",
                                  "--dpp-stage-placement", "v", "--overlap-grad-reduce"], 4,
                                 "--dpp-stage-placement v sums the tied embedding's two copies"),
    "placement_v_per_token_loss": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                    "--num-virtual-stages-per-pipeline-rank", "2",
                                    "--dpp-stage-placement", "v", "--calculate-per-token-loss"], 2,
                                   "--dpp-stage-placement v computes the loss on pipeline rank 0"),
    "dpp_schedule_without_use_dpp": (["--pipeline-model-parallel-size", "2", "--dpp-schedule",
                                      "/nonexistent.csv"], 2,
                                     "--dpp-schedule runs a schedule in the DPP runtime; add "
                                     "--use-dpp"),
    "dpp_schedule_missing": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                              "--dpp-schedule", "/nonexistent/zbv.csv"], 2,
                             "--dpp-schedule /nonexistent/zbv.csv: cannot read it"),
    "dpp_schedule_other_placement": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                      "--num-virtual-stages-per-pipeline-rank", "2",
                                      "--dpp-schedule", "{zbv}"], 2,
                                     "its placement is v:2, the run's interleaved:2x2"),
    "dpp_schedule_other_microbatches": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                         "--num-virtual-stages-per-pipeline-rank", "2",
                                         "--dpp-stage-placement", "v", "--dpp-split-backward",
                                         "--global-batch-size", "4", "--dpp-schedule", "{zbv}"], 2,
                                        "it runs 8 microbatches, the run 4 per iteration"),
    "dpp_schedule_split_backward": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                     "--num-virtual-stages-per-pipeline-rank", "2",
                                     "--dpp-stage-placement", "v", "--dpp-schedule", "{zbv}"], 2,
                                    "its backwards are split (I and W cells), the run's are not "
                                    "(add --dpp-split-backward)"),
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
    # The launchers' pre-check sets GROUP_WORLD_SIZE (ENV below): a one-node job is node 0, whose
    # address must be this machine's; torchrun's ranks also know their node (GROUP_RANK).
    "multi_node_on_one_node_foreign_address": (["--multi-node", "--node-ips", FOREIGN], 1,
                                               f"--node-ips gives node rank 0 the address {FOREIGN}, "
                                               f"but no interface of this machine has it"),
    "multi_node_this_node_foreign_address": (["--multi-node", "--node-ips", f"127.0.0.1,{FOREIGN}"],
                                             2, f"--node-ips gives node rank 1 the address "
                                                f"{FOREIGN}, but no interface"),
    "multi_node_count_mismatch": (["--multi-node", "--node-ips", "127.0.0.1,127.0.0.2"], 1,
                                  "the job has 1 node but 2 addresses are given"),
    # --dpp-memory-budget below what the dynamic policies need: refused before launch, with the
    # minimum the runtime would refuse it with (test_budget_minimum_is_the_runtimes below).
    "memory_budget_below_minimum": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                     "--dpp-memory-budget", "10"], 2,
                                    "--dpp-memory-budget 10 (10 bytes) is below the minimum "
                                    "993280 bytes of --dpp-policy dpp:adaptive"),
    "memory_budget_below_minimum_interleaved": (["--pipeline-model-parallel-size", "2", "--use-dpp",
                                                 "--num-layers-per-virtual-pipeline-stage", "1",
                                                 "--dpp-policy", "dpp:greedy",
                                                 "--dpp-memory-budget", "900kB"], 2,
                                                "--dpp-memory-budget 900kB (900000 bytes) is below "
                                                "the minimum 993280 bytes of --dpp-policy "
                                                "dpp:greedy on these flags (one full-length "
                                                "microbatch, --seq-length x --micro-batch-size, on "
                                                "each of the 2 model chunks of a rank)"),
    "memory_budget_not_a_size": (["--dpp-memory-budget", "lots"], 1,
                                 "--dpp-memory-budget 'lots': expected 'auto', 'provisioned', a "
                                 "multiple of 1F1B's fullest rank such as 1.25x, or a byte count"),
    # A multiple of 1F1B's fullest-rank memory below 1x (a dynamic policy's minimum may be less,
    # but 'less than 1F1B' is a byte count's job).
    "memory_budget_relative_below_one": (["--dpp-memory-budget", "0.8x"], 1,
                                         "--dpp-memory-budget '0.8x': a multiple of 1F1B's "
                                         "fullest-rank memory must be at least 1x"),
    "memory_budget_zero": (["--dpp-memory-budget", "0"], 1,
                           "--dpp-memory-budget '0': the budget must be positive"),
    # Paths: checked before launch, not when training first writes or reads them.
    "save_is_a_file": (["--save", A_FILE], 1, f"--save {A_FILE} exists and is not a directory"),
    "save_under_a_file": (["--save", f"{A_FILE}/checkpoints"], 1,
                          f"--save {A_FILE}/checkpoints: cannot create it in {A_FILE}"),
    "load_is_a_file": (["--load", A_FILE], 1,
                       f"--load {A_FILE} is not a directory; point it at a --save directory"),
    # (without --exit-on-missing-checkpoint: Megatron-LM's warning, and random weights)
    "load_missing": (["--load", "/nonexistent/checkpoints", "--exit-on-missing-checkpoint"], 1,
                     "--load /nonexistent/checkpoints: no such directory"),
    "trace_dir_is_a_file": (["--pipeline-model-parallel-size", "2", "--trace", "--trace-dir", A_FILE],
                            2, f"--trace-dir {A_FILE} exists and is not a directory"),
    "data_cache_path_under_a_file": (["--data-cache-path", f"{A_FILE}/cache"], 1,
                                     f"--data-cache-path {A_FILE}/cache: cannot create it in "
                                     f"{A_FILE}"),
    # Value ranges: each says what is wrong.
    "global_batch_zero": (["--global-batch-size", "0"], 1,
                          "--global-batch-size must be positive, got 0; use a multiple of "
                          "--micro-batch-size 1 x data-parallel size 1 = 1"),
    "global_batch_negative": (["--global-batch-size", "-8"], 1,
                              "--global-batch-size must be positive, got -8"),
    "micro_batch_zero": (["--micro-batch-size", "0"], 1,
                         "--micro-batch-size is required and must be positive"),
    "train_iters_zero": (["--train-iters", "0"], 1, "--train-iters must be positive"),
    # Megatron-LM's two ways to give the lengths, never mixed (TINY trains 5 iterations of 8).
    "train_iters_and_samples": (["--train-samples", "40"], 1,
                                "--train-iters and --train-samples are exclusive; give one"),
    "decay_samples_with_iters": (["--lr-decay-samples", "40"], 1,
                                 "--lr-decay-samples counts samples and --train-iters iterations; "
                                 "use --train-samples, or --lr-decay-iters"),
    "warmup_samples_with_iters": (["--lr-warmup-samples", "8"], 1,
                                  "--lr-warmup-samples counts samples and --train-iters"),
    "warmup_fraction_and_iters": (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"], 1,
                                  "--lr-warmup-fraction and --lr-warmup-iters both give the warmup"),
    "warmup_fraction_one": (["--lr-warmup-fraction", "1"], 1,
                            "--lr-warmup-fraction must be in [0, 1), got 1.0"),
    "warmup_not_below_decay": (["--lr-warmup-iters", "5"], 1,
                               "--lr-decay-iters (5 iterations) must exceed --lr-warmup-iters "
                               "(5 iterations)"),
    "finetune_without_load": (["--finetune"], 1, "--finetune needs --load DIR"),
    "no_load_optim_without_load": (["--no-load-optim"], 1, "--no-load-optim needs --load DIR"),
    "exit_interval_zero": (["--exit-interval", "0"], 1, "--exit-interval must be positive"),
    "exit_duration_negative": (["--exit-duration-in-mins", "-1"], 1,
                               "--exit-duration-in-mins must be positive"),
    "loss_scale_without_16_bit": (["--loss-scale", "128"], 1, "--loss-scale needs --fp16 or --bf16"),
    "dynamic_loss_scale_flag_without_fp16": (["--bf16", "--hysteresis", "3"], 1,
                                             "--hysteresis configures --fp16's dynamic loss scale; "
                                             "add --fp16 or drop it"),
    "dynamic_loss_scale_flag_with_constant": (["--fp16", "--loss-scale", "8",
                                               "--initial-loss-scale", "16"], 1,
                                              "drop --loss-scale (a constant scale) or it"),
    "min_loss_scale_above_initial": (["--fp16", "--initial-loss-scale", "4",
                                      "--min-loss-scale", "8"], 1,
                                     "--min-loss-scale 8 exceeds --initial-loss-scale 4"),
    # Megatron-LM flags its scripts carry that cannot apply here: each says why.
    "rampup_batch_size_by_iterations": (["--rampup-batch-size", "4", "4", "16"], 1,
                                        "--rampup-batch-size counts samples: give "
                                        "--train-samples"),
    "decrease_batch_size_below_one_step": (["--decrease-batch-size-if-needed",
                                            "--micro-batch-size", "4", "--global-batch-size", "2"],
                                           1, "is below one micro-batch on each data-parallel "
                                              "rank"),
    "wandb_project_without_name": (["--wandb-project", "x"], 1,
                                   "--wandb-project needs --wandb-exp-name NAME"),
    "async_save": (["--async-save"], 1, "--async-save (saving in the background) is not built"),
    # --kv-channels now sets the head size (tests/test_gpt_architecture_options.py); a bad one:
    "kv_channels": (["--kv-channels", "0"], 1, "--kv-channels must be positive, got 0"),
    "override_and_use_checkpoint_schedule": (["--override-opt_param-scheduler",
                                              "--use-checkpoint-opt_param-scheduler"], 1,
                                             "--override-opt_param-scheduler and "
                                             "--use-checkpoint-opt_param-scheduler are exclusive"),
    "lr_negative": (["--lr", "-1"], 1, "--lr is required and must be >= 0"),
    "seed_negative": (["--seed", "-1"], 1, "--seed must be in [0, 2**32), got -1"),
    "seed_too_large": (["--seed", str(2**32)], 1, "--seed must be in [0, 2**32)"),
    "adam_beta2_one": (["--adam-beta2", "1"], 1, "--adam-beta2 must be in [0, 1), got 1.0"),
    "adam_beta1_negative": (["--adam-beta1", "-0.1"], 1, "--adam-beta1 must be in [0, 1)"),
    "adam_eps_zero": (["--adam-eps", "0"], 1, "--adam-eps must be positive, got 0.0"),
    "sgd_momentum_with_adam": (["--sgd-momentum", "0.5"], 1,
                               "--sgd-momentum configures --optimizer sgd, and this run's is adam"),
    "sgd_momentum_one": (["--optimizer", "sgd", "--sgd-momentum", "1"], 1,
                         "--sgd-momentum must be in [0, 1), got 1.0"),
    "sgd_distributed_optimizer": (["--optimizer", "sgd", "--use-distributed-optimizer"], 2,
                                  "--optimizer sgd does not run with --use-distributed-optimizer"),
    "weight_decay_negative": (["--weight-decay", "-0.1"], 1, "--weight-decay must be >= 0"),
    "clip_grad_negative": (["--clip-grad", "-1"], 1, "--clip-grad must be >= 0 (0 disables "
                                                     "clipping), got -1.0"),
    "init_method_std_zero": (["--init-method-std", "0"], 1, "--init-method-std must be positive"),
    "ffn_hidden_size_zero": (["--ffn-hidden-size", "0"], 1, "--ffn-hidden-size must be positive"),
    "max_position_embeddings_zero": (["--max-position-embeddings", "0"], 1,
                                     "--max-position-embeddings must be positive"),
    "vocab_divisible_by_zero": (["--make-vocab-size-divisible-by", "0"], 1,
                                "--make-vocab-size-divisible-by must be positive"),
    "dropout_one": (["--hidden-dropout", "1"], 1, "--hidden-dropout must be in [0, 1)"),
    "log_interval_zero": (["--log-interval", "0"], 1, "--log-interval must be positive"),
    "save_interval_zero": (["--save-interval", "0"], 1, "--save-interval must be positive"),
    "dpp_timeout_zero": (["--dpp-timeout", "0"], 1, "--dpp-timeout must be positive seconds"),
    "p2p_timeout_negative": (["--p2p-timeout", "-1"], 1, "--p2p-timeout must be positive seconds"),
    "num_workers_negative": (["--num-workers", "-1"], 1, "--num-workers must be >= 0"),
    # The job key comes in the environment (ENV below): checked with the flags, before launch.
    "job_key_not_hex": ([], 1, "DPP_JOB_KEY must be hexadecimal digits"),
    "job_key_short": ([], 1, "DPP_JOB_KEY holds 16 hexadecimal digits; a job key needs at least "
                             "32"),
}

# Environment a case runs with, beyond WORLD_SIZE and RANK (the launchers' pre-check sets
# GROUP_WORLD_SIZE, torchrun's ranks GROUP_RANK too).
ENV = {
    "multi_node_on_one_node_foreign_address": {"GROUP_WORLD_SIZE": "1"},
    "multi_node_this_node_foreign_address": {"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1",
                                             "LOCAL_WORLD_SIZE": "1"},
    "multi_node_count_mismatch": {"GROUP_WORLD_SIZE": "1"},
    "job_key_not_hex": {"DPP_JOB_KEY": "not a key"},
    "job_key_short": {"DPP_JOB_KEY": "ab" * 8},
}


GPU_ONLY_CASES = ("flash_attn_on_cpu", "nccl_on_cpu", "sequence_parallel_without_te",
                  "nvtx_on_cpu", "profile_nsys_on_cpu")


def _skip_gpu_only_case_on_a_gpu(case):
    if case in GPU_ONLY_CASES:
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("GPU-only flags are valid on this machine")


def _torchrun_environment(monkeypatch, world_size, env_extra=None):
    """The variables torchrun gives a rank, without a rendezvous (no MASTER_ADDR)."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    for name, value in (env_extra or {}).items():
        monkeypatch.setenv(name, value)


def validate_in_process(argv, monkeypatch, capsys, world_size=1, env_extra=None):
    """(exit code, stdout, stderr) of megatron_dpp.pretrain_gpt's flag parsing."""
    from megatron_dpp.arguments import parse_args

    _torchrun_environment(monkeypatch, world_size, env_extra)
    try:
        parse_args(argv, prog="megatron_dpp.pretrain_gpt")
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_exit_2(code, out, err, expected):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1, err
    assert lines[0].startswith("megatron_dpp.pretrain_gpt: error: "), lines[0]
    assert expected in lines[0], lines[0]
    assert out == ""


ZBV_FILE = "{zbv}"  # in a case's flags: torch's own ZB-V schedule file, P=2, M=8


@pytest.fixture(scope="module")
def zbv_file(tmp_path_factory):
    from test_schedule_csv import _torch_zbv_csv

    path = tmp_path_factory.mktemp("schedules") / "zbv.csv"
    _torch_zbv_csv(str(path), 2, 8)
    return str(path)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_is_one_line_exit_2(case, monkeypatch, capsys, zbv_file):
    _skip_gpu_only_case_on_a_gpu(case)
    extra, world_size, expected = BAD_FLAGS[case]
    extra = [zbv_file if flag == ZBV_FILE else flag for flag in extra]
    code, out, err = validate_in_process([*data_args(), *TINY, *extra], monkeypatch, capsys,
                                         world_size, ENV.get(case))
    _assert_one_line_exit_2(code, out, err, expected)


# One case of each kind as a real process: a shape check, a data check (which imports Megatron-Core
# on the way), a path check, the multi-node environment check.
IN_A_PROCESS = ("layers_vs_pipeline", "missing_data_files", "save_is_a_file",
                "multi_node_count_mismatch")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", [case for case in IN_A_PROCESS if case in BAD_FLAGS])
def test_bad_flag_in_a_process(case):
    extra, world_size, expected = BAD_FLAGS[case]
    result = run_validation([*data_args(), *TINY, *extra], world_size=world_size,
                            env_extra=ENV.get(case))
    _assert_one_line_exit_2(result.returncode, result.stdout, result.stderr, expected)


GOOD_FLAGS = {
    "plain": ([], {}),
    "dataloader_type_single": (["--dataloader-type", "single"], {}),
    "trace_without_dpp": (["--trace"], {}),
    "profile": (["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                 "--profile-step-end", "4", "--profile-ranks", "0", "1"], {}),
    # Megatron-LM's flag; the behaviour is always on here (its help says so).
    "exit_signal_handler": (["--exit-signal-handler"], {}),
    # Exactly the minimum of memory_budget_below_minimum; static orders only report a budget.
    "memory_budget_at_minimum": (["--use-dpp", "--dpp-memory-budget", "993280"], {}),
    "memory_budget_static_order": (["--use-dpp", "--dpp-policy", "1f1b", "--dpp-memory-budget",
                                    "10"], {}),
    "memory_budget_relative": (["--use-dpp", "--dpp-memory-budget", "1.25x"], {}),
    "save_and_trace_dir_to_make": (["--save", "/tmp/megatron-dpp-test-never-made/ckpt", "--trace",
                                    "--trace-dir", "/tmp/megatron-dpp-test-never-made/traces"], {}),
    "multi_node_on_one_node_local_address": (["--multi-node", "--node-ips", "127.0.0.1"],
                                             {"GROUP_WORLD_SIZE": "1"}),
    "placement_v_zbv": (["--use-dpp", "--num-virtual-stages-per-pipeline-rank", "2",
                         "--dpp-stage-placement", "v", "--dpp-policy", "zb-v"], {}),
    "placement_v_adaptive_split": (["--use-dpp", "--num-virtual-stages-per-pipeline-rank", "2",
                                    "--dpp-stage-placement", "v", "--dpp-split-backward"], {}),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(GOOD_FLAGS))
def test_good_flags_pass_validation(case, monkeypatch, capsys):
    """The same base flags validate cleanly (so each bad case fails for its own reason); --trace
    without --use-dpp records Megatron's own schedule."""
    extra, env = GOOD_FLAGS[case]
    code, _out, err = validate_in_process(
        [*data_args(), *TINY, "--pipeline-model-parallel-size", "2", *extra], monkeypatch, capsys,
        world_size=2, env_extra=env)
    assert code == 0, err
    assert not os.path.exists("/tmp/megatron-dpp-test-never-made")  # checked, not made


@pytest.mark.timeout(90)
def test_good_flags_pass_the_launchers_precheck():
    """`python -m megatron_dpp.arguments`, as the launchers run it before torchrun."""
    result = subprocess.run(
        [PYTHON, "-m", "megatron_dpp.arguments", *data_args(), *TINY,
         "--pipeline-model-parallel-size", "2"],
        env=dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2"), cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_exit_signal_handler_help_says_it_is_always_on():
    from megatron_dpp.arguments import build_parser

    (action,) = [a for a in build_parser()._actions if "--exit-signal-handler" in a.option_strings]
    assert "does nothing here: its behaviour is always on" in action.help


# Shapes whose minimum budget the flag check and the runtime compute: (model flags, world size).
BUDGET_SHAPES = {
    "gpt_fp32": ([], 2),
    "gpt_interleaved": (["--num-layers-per-virtual-pipeline-stage", "1"], 2),
    "gpt_longer_bigger_batch": (["--seq-length", "128", "--max-position-embeddings", "128",
                                 "--micro-batch-size", "2", "--global-batch-size", "8"], 2),
    "gpt_selective_recompute": (["--recompute-activations"], 2),
    "gpt_full_recompute": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1"], 2),
    "gpt_no_dropout_ffn": (["--hidden-dropout", "0", "--attention-dropout", "0",
                            "--ffn-hidden-size", "96"], 2),
    "gpt_tensor_parallel": (["--tensor-model-parallel-size", "2"], 4),
    "gpt_uneven_split": (["--decoder-last-pipeline-num-layers", "3"], 2),
}


@pytest.mark.parametrize("shape", list(BUDGET_SHAPES))
def test_budget_minimum_is_the_runtimes(shape, monkeypatch):
    """The pre-check's minimum (megatron_dpp.arguments) is the one the schedulers refuse a budget below:
    pipeline/budget.py's minimum over the model's activation bytes of the TransformerConfig the
    training loop builds from the same flags."""
    from megatron_dpp.arguments import dpp_minimum_budget_bytes, parse_args
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.models.transformer_config import transformer_config_from_args
    from megatron_dpp.pipeline import TaskGraph, make_scheduler
    from megatron_dpp.pipeline.budget import largest_microbatch_bytes, minimum_budget_bytes

    extra, world_size = BUDGET_SHAPES[shape]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = parse_args([*data_args(), *TINY, "--pipeline-model-parallel-size", "2", "--use-dpp",
                       *extra], model="gpt")
    V, P = args.parallel.virtual_pipeline_model_parallel_size or 1, args.pipeline_model_parallel_size
    config = transformer_config_from_args(args)
    largest = largest_microbatch_bytes(MODEL_SPECS["gpt"].activation_bytes, config,
                                       args.seq_length, args.micro_batch_size, V, P)
    minimum = dpp_minimum_budget_bytes(args)
    assert minimum == minimum_budget_bytes(V, largest)
    sizes = [args.seq_length * args.micro_batch_size] * (2 * P)
    graph = TaskGraph(P, V, len(sizes), sizes, [largest] * len(sizes), max_act_bytes=largest)
    make_scheduler("dpp:adaptive", graph, 0, budget_bytes=minimum)  # accepted at the minimum
    with pytest.raises(ValueError, match=f"below the minimum V \\* max_act_bytes = {minimum}"):
        make_scheduler("dpp:adaptive", graph, 0, budget_bytes=minimum - 1)
