"""A stand-in for `config.timers`, Megatron-Core's public timing hook: Megatron's Timers interface
(`timers(name, log_level=None)` -> an object with start() and stop()) that calls back when a timer
of a chosen name starts and stops, and passes every call on to the timers it stands in for, if any.

--trace and --nvtx see Megatron's forward and backward steps (its 'forward-compute' and
'backward-compute' timers) and the collectives of its gradient sync (finalize_model_grads' timers)
through it, without wrapping, patching or copying a Megatron function.
"""
from __future__ import annotations

from typing import Callable, Collection, Optional

TimerCallback = Callable[[str], None]  # called with the timer's name


class _NoTimer:
    """A timer that is not kept (none stood in for, or its level is above the one logged)."""

    def start(self, barrier: bool = False) -> None:
        return None

    def stop(self, barrier: bool = False) -> None:
        return None


NO_TIMER = _NoTimer()


class _HookedTimer:
    """One timer of a hooked name: the callback, and the replaced timer."""

    def __init__(self, name: str, timers: "HookedTimers", replaced):
        self.name, self.timers, self.replaced = name, timers, replaced

    def start(self, barrier: bool = False) -> None:
        self.timers.on_start(self.name)
        self.replaced.start(barrier=barrier)

    def stop(self, barrier: bool = False) -> None:
        self.replaced.stop(barrier=barrier)
        self.timers.on_stop(self.name)


class HookedTimers:
    """config.timers while something is observed. `on_start(name)` runs before the replaced timer
    starts and `on_stop(name)` after it stops, for the timers named in `names`."""

    def __init__(self, names: Collection[str], on_start: TimerCallback, on_stop: TimerCallback,
                 replaced=None):
        self.names = frozenset(names)
        self.on_start, self.on_stop = on_start, on_stop
        self.replaced = replaced  # the config's own timers (Megatron-LM's Timers, another stand-in) or None

    def __call__(self, name: str, log_level: Optional[int] = None):
        if self.replaced is None:
            timer = NO_TIMER
        elif log_level is None:
            timer = self.replaced(name)
        else:
            timer = self.replaced(name, log_level=log_level)
        return _HookedTimer(name, self, timer) if name in self.names else timer
