"""Putting every rank's timestamps on rank 0's clock, without a barrier.

Each rank measures its clock's offset to the reference rank twice, at trace start and at trace end,
by ping-pong: it notes its time t_sent, the reference answers with its own time t_reference, and the
answer arrives at t_back. Whatever the two one-way delays, t_reference lies between t_sent and t_back
on this rank's clock, so

    offset = (t_sent + t_back) / 2 - t_reference      (this rank's clock minus the reference's)

is wrong by at most half the round trip. Of several rounds the one with the shortest round trip is
kept (the least queueing). From the two measurements the offset is modelled as a line in local time
(a constant offset plus a linear drift), and a local time t becomes t - offset(t).

Times are microseconds. Standard library only: the exchange itself lives with the process groups
(megatron_dpp.training.observe.clock_sync).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

# Ping-pong rounds per measurement: the first round of a rank often queues behind other ranks at
# the reference; a few more give one without queueing.
ROUNDS = 8

# A device-timed span's args (trace/recorder.py): the host's start and duration of the task, on
# the same clock as ts, so corrected with it.
HOST_START, HOST_DURATION = "host_ts", "host_dur"

# (t_sent, t_reference, t_back): one round, t_sent and t_back on this rank's clock.
Round = Tuple[float, float, float]


@dataclass(frozen=True)
class OffsetSample:
    """This rank's clock minus the reference clock, measured around local time `at_us`, within
    +-error_us."""

    at_us: float
    offset_us: float
    error_us: float


def offset_from_rounds(rounds: Sequence[Round]) -> OffsetSample:
    """The sample of the round with the shortest round trip."""
    if not rounds:
        raise ValueError("offset_from_rounds: no ping-pong round to estimate from")
    sent, reference, back = min(rounds, key=lambda r: r[2] - r[0])
    middle = (sent + back) / 2
    return OffsetSample(at_us=middle, offset_us=middle - reference, error_us=(back - sent) / 2)


def reference_sample(at_us: float) -> OffsetSample:
    """The reference rank's own sample: its clock is the reference."""
    return OffsetSample(at_us=at_us, offset_us=0.0, error_us=0.0)


@dataclass(frozen=True)
class ClockAlignment:
    """offset(t) = offset_us + drift * (t - at_us), t on this rank's clock; corrected t = t - offset(t).

    error_us bounds the error of either measurement (the larger half round trip), hence of the line
    between them for a clock whose drift is steady over the run (a line through two points each
    within +-e of a line stays within +-e of it between them); every event lies between the two."""

    reference_rank: int
    at_us: float
    offset_us: float
    drift: float  # microseconds of offset gained per microsecond of local time
    error_us: float
    # Local time between the two measurements: the drift's own error is at most
    # 2 * error_us / elapsed_us (each end within +-error_us).
    elapsed_us: float = 0.0

    @classmethod
    def from_samples(cls, reference_rank: int, start: OffsetSample,
                     end: OffsetSample) -> "ClockAlignment":
        elapsed = end.at_us - start.at_us
        drift = (end.offset_us - start.offset_us) / elapsed if elapsed > 0 else 0.0
        return cls(reference_rank=reference_rank, at_us=start.at_us, offset_us=start.offset_us,
                   drift=drift, error_us=max(start.error_us, end.error_us),
                   elapsed_us=max(elapsed, 0.0))

    def corrected(self, time_us: float) -> float:
        return time_us - (self.offset_us + self.drift * (time_us - self.at_us))

    def correct_events(self, events: List[dict]) -> List[dict]:
        """Copies of Chrome trace events on the reference clock (spans keep their end too)."""
        fixed = []
        for event in events:
            if "ts" not in event:
                fixed.append(event)
                continue
            event = dict(event)
            start = event["ts"]
            event["ts"] = self.corrected(start)
            if "dur" in event:
                event["dur"] = self.corrected(start + event["dur"]) - event["ts"]
            host_start = event.get("args", {}).get(HOST_START)
            if host_start is not None:
                host_end = host_start + event["args"][HOST_DURATION]
                args = event["args"] = dict(event["args"])
                args[HOST_START] = self.corrected(host_start)
                args[HOST_DURATION] = self.corrected(host_end) - args[HOST_START]
            fixed.append(event)
        return fixed

    def metadata(self) -> Dict[str, object]:
        """otherData.clock_alignment: enough to redo (or undo) the correction."""
        return {"reference_rank": self.reference_rank, "offset_us": self.offset_us,
                "drift": self.drift, "error_us": self.error_us, "measured_at_us": self.at_us,
                "measured_for_us": self.elapsed_us, "timestamps_corrected": True}
