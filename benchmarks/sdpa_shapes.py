"""Attention at a repeated sequence length against a new length every call, per SDPA backend.

With --variable-seq-lengths every micro-batch is padded to its own longest sample, so the
attention sees a new sequence length again and again. torch's cuDNN attention (the first choice
on Hopper and Blackwell GPUs with a recent cuDNN) builds an execution graph for every new shape and
caches it (aten/src/ATen/native/cudnn/MHA.cpp); flash and memory-efficient attention build
nothing. This measures what that costs: forward and backward of scaled_dot_product_attention as
SdpaCoreAttention calls it (query, key and value permuted from Megatron's [s, b, heads, head dim]
layout, causal, the recipe's dropout), one call at a time with the device synchronized, for each
backend: the median of --repeats calls at one length, and of --fresh calls each at a length not
used before in this process. Their difference is the price of a new shape.

Prints a table and writes --json: {"config": {...}, "device_name", "torch", "default_backend" (what
torch picks for the repeated shape), "results": [{"backend", "available", "why", "repeated_ms",
"fresh_ms", "new_shape_ms"}]}. --device cuda (the default) without a GPU says so in one line and
exits 0; --device cpu --quick runs a tiny shape on the CPU (tests).

    python benchmarks/sdpa_shapes.py --json runs/sdpa_shapes.json
    python benchmarks/sdpa_shapes.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# GPT-125m's attention (micro-batch 4, 12 heads of 64) at a typical length, and a tiny one.
FULL = dict(batch=4, heads=12, head_dim=64, length=1024, repeats=10, fresh=10)
QUICK = dict(batch=1, heads=2, head_dim=16, length=32, repeats=3, fresh=3)
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, help_text in (("batch", "samples per micro-batch"), ("heads", "attention heads"),
                            ("head_dim", "channels per head"),
                            ("length", "the repeated sequence length; the new ones lie "
                                       "around it (+1, -1, +2, -2, ...)"),
                            ("repeats", "calls at the repeated length"),
                            ("fresh", "calls at new lengths, per backend")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            help=f"{help_text} ({FULL[name]}; --quick: {QUICK[name]})")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="dropout on the attention probabilities (0.1, the recipe's)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated, of {', '.join(BACKENDS)} (default: all); "
                             "default is torch's own choice")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; the current GPU, bf16) or cpu (fp32)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, few calls (tests)")
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    return parser


def _fail(message: str) -> None:
    print(f"sdpa_shapes: error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.dropout < 1.0:
        _fail("--dropout must be in [0, 1)")
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in args.backends if name not in BACKENDS]
    if unknown or not args.backends:
        _fail(f"--backends: unknown {', '.join(unknown) or '(none given)'}; "
              f"expected some of {', '.join(BACKENDS)}")
    # Every backend gets new lengths of its own around --length, all of them above 0.
    if args.length <= (len(args.backends) * args.fresh + 1) // 2:
        _fail(f"--length {args.length} leaves too few new lengths for {len(args.backends)} "
              f"backends x --fresh {args.fresh}")
    return args


def new_lengths(length: int):
    """length+1, length-1, length+2, length-2, ...: new shapes whose work averages the repeated one's."""
    step = 1
    while True:
        yield length + step
        yield length - step
        step += 1


def _inputs(args, length: int, device: torch.device, dtype: torch.dtype):
    """query, key, value as SdpaCoreAttention hands them to SDPA: [b, heads, s, head dim] views of
    one [s, b, heads, 3 * head dim] projection."""
    qkv = torch.randn(length, args.batch, args.heads, 3 * args.head_dim, device=device,
                      dtype=dtype, requires_grad=True)
    return [t.permute(1, 2, 0, 3) for t in qkv.split(args.head_dim, dim=-1)]


def _call_ms(args, length: int, device, dtype, backend) -> float:
    """One forward and backward at `length`, the device synchronized after: milliseconds."""
    query, key, value = _inputs(args, length, device, dtype)
    # The gradient in the layout SdpaCoreAttention's backward hands over ([s, b, heads, head dim]).
    grad = torch.randn(length, args.batch, args.heads, args.head_dim, device=device,
                       dtype=dtype).permute(1, 2, 0, 3)
    _sync(device)
    start = time.perf_counter()
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=args.dropout,
                                             is_causal=True)
        out.backward(grad)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_backend(args, device, dtype) -> str:
    query, key, value = _inputs(args, args.length, device, dtype)
    choice = SDPBackend(torch._fused_sdp_choice(query, key, value, None, args.dropout, True))
    return {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
            SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}.get(
        choice, str(choice))


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(1234)
    results, lengths = [], new_lengths(args.length)
    for name in args.backends:
        backend = BACKENDS[name]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _call_ms(args, args.length, device, dtype, backend)  # builds what this shape needs
        except RuntimeError as error:
            reasons = [str(w.message).split(" (Triggered")[0] for w in caught]
            why = "; ".join(reasons) or str(error).splitlines()[0]
            results.append({"backend": name, "available": False, "why": why})
            continue
        repeated = [_call_ms(args, args.length, device, dtype, backend) for _ in range(args.repeats)]
        fresh = [_call_ms(args, next(lengths), device, dtype, backend) for _ in range(args.fresh)]
        results.append({"backend": name, "available": True, "why": "",
                        "repeated_ms": statistics.median(repeated),
                        "fresh_ms": statistics.median(fresh),
                        "new_shape_ms": statistics.median(fresh) - statistics.median(repeated)})
    return {
        "config": {name: getattr(args, name) for name in (*FULL, "dropout", "device")},
        "dtype": str(dtype).replace("torch.", ""),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "default_backend": _default_backend(args, device, dtype),
        "results": results,
    }


def print_table(result: dict) -> None:
    config = result["config"]
    print(f"SDPA forward+backward, batch {config['batch']}, {config['heads']} heads of "
          f"{config['head_dim']}, {result['dtype']}, causal, dropout {config['dropout']}, on "
          f"{result['device_name']} (torch {result['torch']}); torch's own choice here: "
          f"{result['default_backend']}")
    print(f"{'backend':10s} {'length ' + str(config['length']) + ' repeated':>22s} "
          f"{'a new length each call':>24s} {'a new shape costs':>18s}")
    for row in result["results"]:
        if not row["available"]:
            print(f"{row['backend']:10s} unavailable: {row['why']}")
            continue
        print(f"{row['backend']:10s} {row['repeated_ms']:19.2f} ms {row['fresh_ms']:21.2f} ms "
              f"{row['new_shape_ms']:15.2f} ms")


def main(argv=None) -> int:
    args = resolve(build_parser().parse_args(argv))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sdpa_shapes: no CUDA GPU here (torch.cuda.is_available() is False); nothing to measure")
        return 0
    result = measure(args)
    print_table(result)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
