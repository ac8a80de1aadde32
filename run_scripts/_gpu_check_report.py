"""The table of run_scripts/gpu_check.sh, from what its steps left in OUTPUT_DIR: steps.tsv (name,
exit status, log, seconds per step), the logs, transport_cuda.json, transport_cuda_mps.json,
sdpa_shapes.json and anchor_*.json. Prints the table, writes OUTPUT_DIR/summary.json, exits 1 when a step failed (0
otherwise).

    python run_scripts/_gpu_check_report.py OUTPUT_DIR --gpt-seq-length 2048 --bert-seq-length 512
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

TARGET_RATIO = 0.8  # issue 26: our GPT-125m at >= 0.8x the eager SDPA anchor's tokens/s
# The gpt step's variants that gpu_check.sh runs (step name: what its report line calls it).
GPT_VARIANTS = {"gpt-fused": "with the compiled fusions", "gpt-graphs": "with CUDA graphs"}
SKIP_LOG_LINES = 1  # the first logged interval holds start-up (allocation, autotuning)
ITERATION_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+).*?"
                          r"global batch size:\s+(\d+).*?lm loss: ([-+0-9.eE]+)")
# Megatron-LM's memory line, which the trainer prints once on a GPU (training/loop.py memory_report).
MAX_ALLOCATED_RE = re.compile(r"\(after \d+ iterations\) memory \(MB\) \| allocated: [0-9.]+ "
                              r"\| max allocated: ([0-9.]+)")
PYTEST_SUMMARY_RE = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|error|deselected).*?)\s*=*$")


def read_steps(output_dir: Path) -> list[dict]:
    steps = []
    for line in (output_dir / "steps.tsv").read_text().splitlines():
        name, status, log, seconds = line.split("\t")
        steps.append({"name": name, "exit_status": int(status), "log": log, "seconds": int(seconds)})
    return steps


def training_figures(log_text: str, seq_length: int) -> dict:
    """tokens/s (global batch x sequence / the median time per iteration after the first logged
    interval), the first and last lm loss of a training log, and the largest rank's peak of
    allocated memory where the log reports it (MB, None otherwise)."""
    lines = [(float(ms), int(batch), float(loss)) for ms, batch, loss in ITERATION_RE.findall(log_text)]
    if not lines:
        return {}
    steady = lines[SKIP_LOG_LINES:] or lines
    ms = statistics.median(ms for ms, _, _ in steady)
    peaks = [float(mb) for mb in MAX_ALLOCATED_RE.findall(log_text)]
    return {"ms_per_iteration": ms, "tokens_per_s": steady[-1][1] * seq_length / (ms / 1e3),
            "first_loss": lines[0][2], "last_loss": lines[-1][2],
            "max_allocated_mb": max(peaks) if peaks else None}


def pytest_summary(log_text: str) -> str:
    for line in reversed(log_text.splitlines()):
        match = PYTEST_SUMMARY_RE.match(line.strip())
        if match:
            return match.group(1)
    return ""


def _load(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def _rate(tokens_per_s: Optional[float]) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s / 1e3:.1f}k tokens/s"


def _peak(max_allocated_mb: Optional[float]) -> str:
    return "" if max_allocated_mb is None else f", peak {max_allocated_mb / 1024:.1f} GiB allocated"


def _ipc_lines(transport: Optional[dict]) -> list[str]:
    if not transport:
        return []
    rows = {(row["transport"], row["bytes"]): row for row in transport["results"]}
    lines = []
    for size in transport["config"]["sizes"]:
        shm, host, d2d, events, nccl = (rows.get((name, size))
                                        for name in ("shm", "shm-host", "d2d", "events", "nccl"))
        parts = []
        if shm:
            parts.append("shm refused (slot too small)" if shm["refused"]
                         else f"shm {shm['one_way_us_p50']:.1f} us")
        if host and not host["refused"]:
            parts.append(f"host side {host['one_way_us_p50']:.1f} us")
        if d2d:
            parts.append(f"device copy {d2d['one_way_us_p50']:.1f} us")
        if events:
            parts.append(f"bare event hand-over {events['one_way_us_p50']:.1f} us")
        if nccl:
            parts.append(f"nccl {nccl['one_way_us_p50']:.1f} us")
        lines.append(f"  {size:>10} B one-way: " + ", ".join(parts))
    lines += [f"  {name}: skipped: {reason}" for name, reason in transport["skipped"].items()]
    return lines


def _attention_lines(shapes: Optional[dict]) -> list[str]:
    """benchmarks/sdpa_shapes.py's figures: what a new sequence length costs each SDPA backend."""
    if not shapes:
        return []
    config = shapes["config"]
    lines = [f"SDPA forward+backward at length {config['length']} repeated / a new length each call "
             f"(torch's choice here: {shapes['default_backend']}):"]
    for row in shapes["results"]:
        lines.append(f"  {row['backend']}: " + (
            f"{row['repeated_ms']:.2f} / {row['fresh_ms']:.2f} ms (a new shape "
            f"{row['new_shape_ms']:+.2f} ms)" if row["available"]
            else f"unavailable: {row['why'][:100]}"))
    return lines


def _ratio_key(step_name: str) -> str:
    """summary.json's key of a GPT variant's ratio to the anchor: gpt-fused -> gpt_fused_vs_anchor."""
    return step_name.replace("-", "_") + "_vs_anchor"


def summarize(output_dir: Path, seq_lengths: dict) -> dict:
    steps = read_steps(output_dir)
    anchors = {"anchor": _load(output_dir / "anchor_sdpa.json"),
               "anchor-unfused": _load(output_dir / "anchor_unfused.json")}
    for step in steps:
        text = (output_dir / step["log"]).read_text(errors="replace")
        passed = step["exit_status"] == 0
        if step["name"] in seq_lengths:
            figures = training_figures(text, seq_lengths[step["name"]])
            step.update(figures)
            passed = passed and bool(figures) and figures["last_loss"] < figures["first_loss"]
            step["detail"] = (f"{_rate(figures.get('tokens_per_s'))}, lm loss "
                              f"{figures['first_loss']:.2f} -> {figures['last_loss']:.2f}"
                              + _peak(figures["max_allocated_mb"])
                              if figures else "")  # the log's last line, below
        elif step["name"] == "tests":
            step["detail"] = pytest_summary(text)
        elif step["name"] in anchors:
            anchor = anchors[step["name"]]
            step["tokens_per_s"] = anchor["tokens_per_s"] if anchor else None
            step["detail"] = _rate(step["tokens_per_s"])
        elif step["name"] in ("transport", "transport-mps") and passed:
            step["detail"] = "CUDA IPC figures below"
        elif step["name"] == "attention-shapes" and passed:
            step["detail"] = "SDPA figures below"
        else:
            step["detail"] = ""
        if step["exit_status"] in (124, 137):  # gpu_check.sh's timeout stopped it
            step["detail"] = f"timed out after {step['seconds']} s"
        if not passed and not step["detail"]:
            step["detail"] = text.strip().splitlines()[-1][:100] if text.strip() else ""
        step["passed"] = passed
    by_name = {step["name"]: step for step in steps}
    anchor = by_name.get("anchor", {}).get("tokens_per_s")

    def over_anchor(name: str) -> Optional[float]:
        ours = by_name.get(name, {}).get("tokens_per_s")
        return ours / anchor if ours and anchor else None

    return {"steps": steps, "gpt_vs_anchor": over_anchor("gpt"),
            **{_ratio_key(name): over_anchor(name) for name in GPT_VARIANTS},
            "target_ratio": TARGET_RATIO,
            "transport": _load(output_dir / "transport_cuda.json"),
            "transport_mps": _load(output_dir / "transport_cuda_mps.json"),
            "attention_shapes": _load(output_dir / "sdpa_shapes.json")}


def print_summary(summary: dict, output_dir: Path) -> None:
    print(f"gpu_check: results in {output_dir}")
    print(f"{'step':<16} {'result':<7} {'seconds':>7}  detail")
    for step in summary["steps"]:
        print(f"{step['name']:<16} {'pass' if step['passed'] else 'FAIL':<7} {step['seconds']:>7}  "
              f"{step['detail']}")
    ratio = summary["gpt_vs_anchor"]
    if ratio is not None:
        verdict = "meets" if ratio >= TARGET_RATIO else "below"
        print(f"our GPT / SDPA anchor: {ratio:.2f}x ({verdict} the target {TARGET_RATIO}x)")
    for name, what in GPT_VARIANTS.items():
        variant = summary.get(_ratio_key(name))
        if variant is not None:
            print(f"our GPT {what} / SDPA anchor: {variant:.2f}x")
    ipc = _ipc_lines(summary["transport"])
    if ipc:
        print("CUDA IPC (bf16, two processes on one GPU):")
        print("\n".join(ipc))
    ipc = _ipc_lines(summary.get("transport_mps"))
    if ipc:
        print("CUDA IPC under MPS (the two processes share the GPU without switching):")
        print("\n".join(ipc))
    attention = _attention_lines(summary.get("attention_shapes"))
    if attention:
        print("\n".join(attention))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--gpt-seq-length", type=int, required=True)
    parser.add_argument("--bert-seq-length", type=int, required=True)
    args = parser.parse_args(argv)
    summary = summarize(args.output_dir, {"gpt": args.gpt_seq_length,
                                          **{name: args.gpt_seq_length for name in GPT_VARIANTS},
                                          "bert": args.bert_seq_length})
    print_summary(summary, args.output_dir)
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(step["passed"] for step in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
