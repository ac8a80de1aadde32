"""GPU training-speed anchor: a plain PyTorch GPT of the GPT-125m recipe's shape and work.

examples/gpt3/gpt3_125m.sh's model (12 layers, hidden 768, 12 heads, seq 2048, learned positions,
pre-LayerNorm blocks, GELU MLP of 4 x hidden, output layer tied to the embedding, dropout 0.1 on
attention probabilities and hidden states), vocab 4096 like the sample data, micro-batch 4 x 8
micro-batches per step, bf16 autocast, fused AdamW. Attention is torch's
scaled_dot_product_attention (eager), or with --unfused written out as Megatron-Core's local
path computes it (matmul, causal mask, fp32 softmax, dropout, matmul). It measures what the same
GPU does with no framework around the model: run_scripts/gpu_check.sh compares our GPT-125m's
tokens/s with it (the target is at least 0.8x the SDPA anchor).

Prints a table and writes --json: {"config": {...}, "tokens_per_s", "ms_per_step": {min, median,
max}, "tokens_per_s_by_step": {min, median, max}, "params", "model_tflops", "losses"} over --steps
measured steps after --warmup-steps. --device cpu --quick runs a tiny shape on the CPU (tests);
--device cuda (the default) without a GPU says so in one line and exits 0, as gpu_check.sh.

    python benchmarks/gpu_speed_anchor.py --json runs/anchor.json
    python benchmarks/gpu_speed_anchor.py --unfused
    python benchmarks/gpu_speed_anchor.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# Shape and work: the GPT-125m recipe (full) and a tiny one for --quick; a flag given wins over both.
FULL = dict(layers=12, hidden=768, heads=12, seq_length=2048, vocab=4096, micro_batch_size=4,
            micro_batches=8, warmup_steps=3, steps=10)
QUICK = dict(layers=2, hidden=64, heads=4, seq_length=64, vocab=128, micro_batch_size=2,
             micro_batches=2, warmup_steps=1, steps=2)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, unfused: bool):
        super().__init__()
        self.heads, self.dropout, self.unfused = heads, dropout, unfused
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, q, k, v):
        p = self.dropout if self.training else 0.0
        if not self.unfused:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).float().softmax(-1).to(q.dtype)
        return F.dropout(probs, p, self.training) @ v

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(h, dim=2))
        y = self.attention(q, k, v).transpose(1, 2).reshape(b, t, h)
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_length: int, layers: int, hidden: int, heads: int,
                 dropout: float, unfused: bool):
        super().__init__()
        self.vocab = vocab
        self.embedding, self.position = nn.Embedding(vocab, hidden), nn.Embedding(seq_length, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout, unfused) for _ in range(layers))
        self.final_ln = nn.LayerNorm(hidden)
        self.dropout = dropout

    def forward(self, tokens, labels):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = F.dropout(self.embedding(tokens) + self.position(positions), self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.final_ln(x) @ self.embedding.weight.t()  # output layer tied to the embedding
        return F.cross_entropy(logits.float().view(-1, self.vocab), labels.reshape(-1))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape = parser.add_argument_group("shape and work (default: the GPT-125m recipe; --quick: tiny)")
    shape.add_argument("--layers", type=int, help=f"transformer layers ({FULL['layers']})")
    shape.add_argument("--hidden", type=int, help=f"hidden size ({FULL['hidden']})")
    shape.add_argument("--heads", type=int, help=f"attention heads ({FULL['heads']})")
    shape.add_argument("--seq-length", type=int, help=f"tokens per sample ({FULL['seq_length']})")
    shape.add_argument("--vocab", type=int, help=f"vocabulary size ({FULL['vocab']}, the sample data's)")
    shape.add_argument("--micro-batch-size", type=int,
                       help=f"samples per micro-batch ({FULL['micro_batch_size']})")
    shape.add_argument("--micro-batches", type=int,
                       help=f"micro-batches per optimizer step ({FULL['micro_batches']})")
    shape.add_argument("--warmup-steps", type=int,
                       help=f"steps run before measuring ({FULL['warmup_steps']})")
    shape.add_argument("--steps", type=int, help=f"measured steps ({FULL['steps']})")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="dropout on attention probabilities and hidden states (0.1, the recipe's)")
    parser.add_argument("--lr", type=float, default=6e-4, help="AdamW learning rate (6e-4)")
    parser.add_argument("--unfused", action="store_true",
                        help="attention written out (matmul, mask, fp32 softmax, dropout), as "
                             "Megatron-Core's local attention; default: scaled_dot_product_attention")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16: autocast to bfloat16 (default); fp32: no autocast")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; the current GPU) or cpu")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny shape and 1 + 2 steps (for tests; with --device cpu)")
    parser.add_argument("--seed", type=int, default=1234, help="weights, dropout and data seed")
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("layers", "hidden", "heads", "seq_length", "vocab", "micro_batch_size",
                 "micro_batches", "steps"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup_steps < 0:
        _fail("--warmup-steps must be >= 0")
    if args.hidden % args.heads:
        _fail(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if not 0.0 <= args.dropout < 1.0:
        _fail("--dropout must be in [0, 1)")
    return args


def _fail(message: str) -> None:
    print(f"gpu_speed_anchor: error: {message}", file=sys.stderr)
    sys.exit(2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast, as Megatron
    model = GPT(args.vocab, args.seq_length, args.layers, args.hidden, args.heads, args.dropout,
                args.unfused).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    data = torch.randint(0, args.vocab, (args.micro_batches, args.micro_batch_size,
                                         args.seq_length + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for m in range(args.micro_batches):
            with autocast:
                loss = model(data[m, :, :-1], data[m, :, 1:]) / args.micro_batches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    for _ in range(args.warmup_steps):
        step()
    _sync(device)
    seconds, losses = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        _sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))  # after the step's timing
    tokens_per_step = args.micro_batches * args.micro_batch_size * args.seq_length
    params = sum(p.numel() for p in model.parameters())
    tokens_per_s = tokens_per_step * len(seconds) / sum(seconds)
    # 6 FLOPs per parameter and token (forward + backward), plus attention's scores and values.
    flops_per_token = 6 * params + 12 * args.layers * args.hidden * args.seq_length
    by_step = [tokens_per_step / s for s in seconds]
    return {
        "config": {name: getattr(args, name) for name in (
            *FULL, "dropout", "lr", "unfused", "precision", "device", "seed")},
        "attention": "unfused" if args.unfused else "sdpa",
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "ms_per_step": {"min": min(seconds) * 1e3, "median": statistics.median(seconds) * 1e3,
                        "max": max(seconds) * 1e3},
        "tokens_per_s_by_step": {"min": min(by_step), "median": statistics.median(by_step),
                                 "max": max(by_step)},
        "params": params,
        "model_tflops": flops_per_token * tokens_per_s / 1e12,
        "losses": losses,
    }


def print_table(result: dict) -> None:
    config, ms = result["config"], result["ms_per_step"]
    print(f"plain PyTorch GPT ({config['layers']} layers, hidden {config['hidden']}, "
          f"{config['heads']} heads, seq {config['seq_length']}, vocab {config['vocab']}, "
          f"{config['micro_batch_size']} x {config['micro_batches']} micro-batches, "
          f"{result['params'] / 1e6:.1f}M params) on {result['device_name']}, "
          f"{config['precision']}, attention {result['attention']}, {config['steps']} steps after "
          f"{config['warmup_steps']} warm-up")
    print(f"{'tokens/s':>12} {'ms/step min':>12} {'median':>9} {'max':>9} {'TFLOP/s':>8}")
    print(f"{result['tokens_per_s']:>12.0f} {ms['min']:>12.1f} {ms['median']:>9.1f} "
          f"{ms['max']:>9.1f} {result['model_tflops']:>8.2f}")


def main(argv=None) -> int:
    args = resolve(build_parser().parse_args(argv))
    if args.device == "cuda" and not torch.cuda.is_available():
        # As transport_bench.py --device cuda and gpu_check.sh: nothing to measure is no error.
        print("gpu_speed_anchor: --device cuda: no CUDA GPU here (torch.cuda.is_available() is "
              "False); nothing measured (--device cpu runs on the CPU)")
        return 0
    result = measure(args)
    print_table(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
