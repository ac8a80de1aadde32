"""A torchrun entry point for benchmarks/real_model_bench.py: every variant's schedule on the same
batches, in one process per rank, one variant after the other for each batch.

    VARIANTS='{"megatron-1f1b": [], "dpp:adaptive": ["--use-dpp"]}' BATCHES=20 \
    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        benchmarks/schedules_in_one_process.py <pretrain_gpt flags>

Each rank is pinned to a core of its own (pinned_rank.py). From the pretrain_gpt flags plus each
variant's extra flags (VARIANTS, JSON: name -> flags) it builds the variant's forward-backward
function (training/pipeline.py, as training does) and a model: one for every variant without
--dpp-split-backward and one with its deferred layers for those with it, both from the same seed,
so their weights are equal. Then for each of BATCHES batches it reads the batch once and runs every
variant's forward-backward on it (gradient sync included, no optimizer step: the weights stay
equal), the variants' order rotating from batch to batch. Variants compared on one batch run
seconds apart, so a change in the machine's speed, which on shared cores lasts longer than that,
falls on all of them alike; separate training runs cannot pair that closely.

At the end rank 0 prints one line, RESULT_PREFIX and JSON: {"times_ms": {variant: [per batch]},
"busy_ms": {variant: [[per rank] per batch]}, "order": [[variant, ...] per batch]}. times_ms: the
slowest rank's time of the forward-backward call (every rank starts it after a barrier). busy_ms
(DPP variants): the time each rank spent in its tasks' compute, per task kind ({"F": ms, "B": ms,
"W": ms}: the spans of its F, B and W tasks).
"""
import json
import os
import sys
import time

from pinned_rank import pin_to_own_core

RESULT_PREFIX = "SCHEDULES_RESULT "


def main() -> int:
    pin_to_own_core()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dpp.arguments import parse_args
    from megatron_dpp.data.iterators import build_data_iterators
    from megatron_dpp.data.tokenizer import build_tokenizer
    from megatron_dpp.models import MODEL_SPECS
    from megatron_dpp.platform import setup_platform
    from megatron_dpp.training.config import training_config_from_args
    from megatron_dpp.training.setup import build_model_and_optimizer, initialize_distributed, set_seeds
    from megatron_dpp.training.pipeline import build_forward_backward, close_forward_backward

    variants = json.loads(os.environ["VARIANTS"])
    batches = int(os.environ["BATCHES"])
    spec = MODEL_SPECS["gpt"]
    argv = sys.argv[1:]
    args_of = {name: parse_args([*argv, *extra], prog="schedules_in_one_process.py")
               for name, extra in variants.items()}
    base = parse_args(argv, prog="schedules_in_one_process.py")
    platform = setup_platform(spec.cpu_patched_modules)
    initialize_distributed(base, platform)
    try:
        set_seeds(base.seed)
        tokenizer = build_tokenizer(base)
        for args in args_of.values():  # what build_tokenizer sets on the args it gets
            args.padded_vocab_size = base.padded_vocab_size
        train_ds, _valid_ds, _test_ds = spec.build_datasets(base, tokenizer)
        models = {}  # --dpp-split-backward or not -> model chunks (same seed, same weights)
        for args in args_of.values():
            split = bool(getattr(args, "dpp_split_backward", False))
            if split not in models:
                set_seeds(base.seed)
                models[split] = build_model_and_optimizer(args, platform, base.seed, spec)[:2]
        forward_backward = {name: build_forward_backward(args, spec) for name, args in args_of.items()}
        train = training_config_from_args(base)
        chunks = len(next(iter(models.values()))[1])
        # One iterator per model chunk over the same sample stream, as training reads it.
        iterators = [build_data_iterators(base, train_ds, None, None, consumed_train_samples=0,
                                          consumed_valid_samples=0)[0] for _ in range(chunks)]
        forward_step = spec.make_forward_step(base, platform.device)
        names = list(variants)
        times = {name: [] for name in names}
        busy = {name: [] for name in names}
        orders = []
        for batch_index in range(batches):
            # The batch, read once: every variant gets the same microbatches.
            batch = [[next(it) for _ in range(train.num_microbatches)] for it in iterators]
            shift = batch_index % len(names)
            order = names[shift:] + names[:shift]
            orders.append(order)
            for name in order:
                args = args_of[name]
                config, model = models[bool(getattr(args, "dpp_split_backward", False))]
                for chunk in model:
                    chunk.zero_grad_buffer()
                data = [iter(items) for items in batch]
                dist.barrier()
                started = time.perf_counter()
                forward_backward[name](
                    forward_step_func=forward_step,
                    data_iterator=data if len(data) > 1 else data[0],
                    model=model, num_microbatches=train.num_microbatches,
                    seq_length=train.seq_length, micro_batch_size=train.micro_batch_size,
                    decoder_seq_length=train.seq_length, forward_only=False)
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item() * 1e3)
                record = getattr(forward_backward[name], "last_record", None)
                mine = None
                if record is not None:  # compute ms per task kind: {"F": .., "B": .., "W": ..}
                    mine = {}
                    for ran in record.ran:
                        kind = ran.task.phase.name
                        mine[kind] = mine.get(kind, 0.0) + (ran.ended - ran.started) * 1e3
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, mine)
                busy[name].append(gathered if record is not None else None)
            if dist.get_rank() == 0:
                print(f"batch {batch_index + 1}/{batches}: "
                      + ", ".join(f"{name} {times[name][-1]:.0f} ms" for name in names), flush=True)
        for function in forward_backward.values():
            close_forward_backward(function)
        if dist.get_rank() == 0:
            line = RESULT_PREFIX + json.dumps({"times_ms": times, "busy_ms": busy, "order": orders})
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        return 0
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
