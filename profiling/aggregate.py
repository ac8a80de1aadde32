"""`python profiling/aggregate.py --benchmark_dir DIR ...`: the command users know, kept under its
old path. The trace analysis itself is trace_analysis/ (`python trace_analysis/aggregate.py`,
the same flags); see docs/tracing.md."""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
runpy.run_module("trace_analysis.aggregate", run_name="__main__", alter_sys=True)
