"""Which iterations to analyse. `a:b` is Python's half-open range of iteration numbers (as the trace
numbers them, from 0); either end may be left out. The default leaves out the first iteration: it
pays one-time costs (allocator warm-up, first-touch of buffers, lazy initialisation) that say
nothing about the schedule."""
from __future__ import annotations

from typing import List, Optional, Tuple

from trace_analysis.load import TraceInputError

IterationRange = Tuple[Optional[int], Optional[int]]


def parse_iteration_range(text: str) -> IterationRange:
    """'2:5' -> (2, 5); '3:' -> (3, None); ':4' -> (None, 4). Raises TraceInputError otherwise."""
    start, colon, stop = text.partition(":")
    try:
        if not colon:
            raise ValueError
        bounds = (int(start) if start.strip() else None, int(stop) if stop.strip() else None)
    except ValueError:
        raise TraceInputError(f"--iterations {text!r}: expected a:b (iteration numbers, b excluded), "
                              "e.g. 1:5, 2: or :4") from None
    if any(bound is not None and bound < 0 for bound in bounds):
        raise TraceInputError(f"--iterations {text!r}: iteration numbers start at 0")
    return bounds


def select_iterations(available: List[int], chosen: Optional[IterationRange]) -> Tuple[List[int], str]:
    """The iterations to analyse and a line saying which (and why, for the default)."""
    if not available:
        raise TraceInputError("the run recorded no training iteration")
    if chosen is None:
        if len(available) == 1:
            return available, f"iteration {available[0]} (the only one, warm-up included)"
        picked = available[1:]
        return picked, (f"iterations {_span(picked)} ({len(picked)} of {len(available)}; the first, "
                        "warm-up, is left out: --iterations to choose)")
    start, stop = chosen
    picked = [i for i in available if (start is None or i >= start) and (stop is None or i < stop)]
    if not picked:
        raise TraceInputError(f"--iterations {_format(chosen)} selects none of the recorded iterations "
                              f"{_span(available)}")
    return picked, f"iterations {_span(picked)} ({len(picked)} of {len(available)})"


def _span(iterations: List[int]) -> str:
    if iterations == list(range(iterations[0], iterations[-1] + 1)) and len(iterations) > 1:
        return f"{iterations[0]}-{iterations[-1]}"
    return ", ".join(map(str, iterations))


def _format(chosen: IterationRange) -> str:
    return ":".join("" if bound is None else str(bound) for bound in chosen)
