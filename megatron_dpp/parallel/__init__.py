"""The parallel layout: its flags and checks (flags.py), the layout they imply (layout.py's frozen
ParallelLayout, `args.parallel` once validated), how the layers split over pipeline stages
(split.py) and the Megatron-LM parallelism flags refused or stated here (megatron_lm_flags.py).
Standard library only (Megatron-Core's layout parser is imported where a layout string is parsed).
"""
