"""--trace on the tiny GPT (pp=2, --use-dpp): one Chrome trace per rank, every task once per
iteration, no two tasks of a rank at once, every receive after its send, memory within budget."""
import json

import pytest

from _train_util import run_training

ITERATIONS, MICROBATCHES = 3, 8


@pytest.mark.timeout(300)
def test_traced_run_writes_one_consistent_trace_per_rank(tmp_path):
    rc, losses, _, out = run_training(
        ["--pipeline-model-parallel-size", "2", "--use-dpp", "--p2p-transport", "shm",
         "--variable-seq-lengths", "--train-iters", str(ITERATIONS), "--trace",
         "--trace-dir", str(tmp_path)], nproc=2, timeout=240)
    assert rc == 0, out[-3000:]
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1 and runs[0].name.endswith("-pp2-dpp"), runs
    traces = {rank: json.loads((runs[0] / f"benchmark-rank{rank}.json").read_text())
              for rank in range(2)}
    sends, receives = {}, []
    for rank, trace in traces.items():
        assert trace["otherData"]["run"] == runs[0].name and trace["otherData"]["rank"] == rank
        events = trace["traceEvents"]
        tasks = [e for e in events if e.get("cat") in ("forward", "backward")]
        for iteration in range(ITERATIONS):
            names = sorted(e["name"] for e in tasks if e["args"]["iteration"] == iteration)
            expected = sorted(f"{phase}{m}.0" for phase in "FB" for m in range(MICROBATCHES))
            assert names == expected, (rank, iteration, names)
        busy = sorted((e["ts"], e["ts"] + e["dur"], e["name"])
                      for e in events if e.get("ph") == "X" and e["tid"] == 0)
        for (_, end, first), (start, _, second) in zip(busy, busy[1:]):
            assert start >= end - 1.0, f"rank {rank}: {second} starts before {first} ends"
        assert all(e["args"]["reason"] for e in events if e.get("cat") == "idle")
        memory = [e["args"] for e in events if e.get("ph") == "C"]
        assert memory and all(0 <= m["held"] <= m["budget"] for m in memory)
        for e in events:
            if e.get("cat") == "message" and e["name"].startswith("send"):
                sends[(rank, e["args"]["peer"], e["args"]["tag"])] = e["ts"]
            elif e.get("cat") == "message":
                receives.append((e["args"]["peer"], rank, e["args"]["tag"], e["ts"]))
    assert receives and len(receives) == len(sends)
    for peer, rank, tag, received in receives:
        assert sends[(peer, rank, tag)] <= received, (peer, rank, tag)
