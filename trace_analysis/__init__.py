"""Offline analysis of a --trace run: `python profiling/aggregate.py --benchmark_dir DIR`.

Modules, one job each:
  load.py           find the run directory, read and check the per-rank files, align their clocks
  timeline.py       typed tasks, waits, messages and memory samples out of a rank's events
  iterations.py     which iterations to analyse (--iterations a:b, the default without warm-up)
  messages.py       pair every receive with its send
  merge.py          one Chrome trace for all ranks, with flow arrows from sends to receives
  analysis.py       busy time, idle time by reason, bubble fraction, per iteration and rank
  critical_path.py  the longest chain of dependent tasks of an iteration
  replay.py         the measured durations run through the simulator under every policy
  report.py         the printed tables
  plots.py          the PNG plots (matplotlib, Agg)
  aggregate.py      the command line
"""
