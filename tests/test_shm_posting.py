"""What shm_tensor's isend costs its caller: it never waits for a slot (a send that finds none is
queued and written by a later progress call), and it is not preempted by the peer it wakes when
both share a CPU (waits sleep as SCHED_BATCH, ShmConfig.batch_while_sleeping); waits put the thread
back to its own policy. The reproduction behind these is tests/_shm_posting.py (docs/transport.md,
"Posting a send")."""
from __future__ import annotations

import os
import platform
import resource
import threading
import time

import pytest
import torch

import shm_tensor
from shm_tensor import ShmConfig
from _shm_posting import cpu_work, posting_round
from _shm_util import block_syscall, payload, run_ranks

KiB = 1 << 10
ACTIVATION = (256, 2, 128)  # the tiny GPT's largest activation: seq 256 x micro-batch 2 x hidden 128 (256 KiB)


def _context(rank, world, store, **config):
    config = dict(num_slots=4, slot_bytes=1 << 20, timeout_s=60, **config)
    return shm_tensor.create_context_with_store(
        store, rank=rank, world_size=world, peers=[1 - rank], config=ShmConfig(**config))


def _finish(ctx, peer):
    """Both sides get here before either closes (close is collective)."""
    ctx.isend(torch.zeros(1), peer, 10**9).wait(timeout=60)
    ctx.irecv(peer, 10**9).wait(timeout=60)
    ctx.close()


# ---------------------------------------------------------------------------------------------
# No free slot: the send is queued, isend returns at once.

def _unreceived_worker(rank, world, store, count):
    ctx = _context(rank, world, store)
    peer = 1 - rank
    if rank == 0:
        walls, handles = [], []
        for tag in range(count):
            start = time.perf_counter()
            handles.append(ctx.isend(payload(0, tag, torch.float32, ACTIVATION), peer, tag))
            walls.append(time.perf_counter() - start)
        stats = ctx.post_stats()
        pending_before = sum(not h.test() for h in handles)
        store.set("posted", "1")  # only now does the peer start receiving
        for handle in handles:
            handle.wait(timeout=60)
        _finish(ctx, peer)
        return {"walls": walls, "stats": stats, "pending_before": pending_before}
    store.wait(["posted"])
    ok = all(torch.equal(ctx.irecv(peer, tag).wait(timeout=60), payload(0, tag, torch.float32, ACTIVATION))
             for tag in range(count))
    _finish(ctx, peer)
    return {"ok": ok}


def test_isends_to_a_peer_that_receives_nothing_yet_return_at_once(tmp_path):
    count = 12  # three times the 4 slots
    result = run_ranks(_unreceived_worker, 2, tmp_path, count, timeout_s=120)
    sender = result[0]
    # Four got a slot and were written by the caller; the others wait in the queue, not the caller.
    assert sender["stats"]["written_at_post"] == 4, sender["stats"]
    assert sender["stats"]["queued_at_post"] == count - 4, sender["stats"]
    assert sender["stats"]["bytes_copied_at_post"] == 4 * 256 * KiB, sender["stats"]
    assert sender["pending_before"] == count - 4
    # Generous bound (a loaded machine): the queued ones copy nothing at all.
    assert max(sender["walls"]) < 0.25, sender["walls"]
    assert result[1]["ok"]  # and every message arrived intact once the peer received


# ---------------------------------------------------------------------------------------------
# A peer asleep in a wait on the same CPU: posting to it must not hand the CPU over.

def _sleeping_peer_worker(rank, world, store, count, config):
    os.sched_setaffinity(0, {0})  # one CPU for both: the oversubscribed case, made deterministic
    ctx = _context(rank, world, store, **config)
    peer = 1 - rank
    if rank == 0:
        walls, returned, preempted = [], [], 0
        for tag in range(count):
            cpu_work(5.0)  # the peer meanwhile falls asleep waiting for this message
            tensor = torch.randn(ACTIVATION)
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            start = time.perf_counter()
            ctx.isend(tensor, peer, tag)
            walls.append(time.perf_counter() - start)
            returned.append(time.monotonic())  # the clock both processes read
            preempted += resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw > before
        stats = ctx.post_stats()
        _finish(ctx, peer)
        return {"walls": walls, "returned": returned, "preempted": preempted, "stats": stats,
                "fallback": ctx.batch_sleep_fallback()}
    held, woke = [], []
    for tag in range(count):
        held.append(ctx.irecv(peer, tag).wait(timeout=60))  # asleep until rank 0 posts
        woke.append(time.monotonic())
        cpu_work(3.0)  # then busy: a woken peer that preempted rank 0 would keep it off the CPU
    stats = ctx.post_stats()
    _finish(ctx, peer)
    return {"stats": stats, "woke": woke, "policy": os.sched_getscheduler(0),
            "fallback": ctx.batch_sleep_fallback()}


@pytest.mark.alone  # who runs first on the shared CPU: another worker's ranks there would decide
def test_posting_to_a_sleeping_peer_on_a_shared_cpu_returns_at_once(tmp_path):
    count = 20
    result = run_ranks(_sleeping_peer_worker, 2, tmp_path, count, {}, timeout_s=120)
    sender, receiver = result[0], result[1]
    if receiver["fallback"]:
        pytest.skip(f"waits cannot sleep as SCHED_BATCH here: {receiver['fallback']}")
    # The scenario happened: most posts found the peer asleep and woke it, which slept as SCHED_BATCH.
    assert sender["stats"]["wakes_at_post"] >= count // 2, sender["stats"]
    assert receiver["stats"]["sleeps_as_batch"] == receiver["stats"]["sleeps"] > 0, receiver["stats"]
    assert receiver["policy"] == os.SCHED_OTHER  # back to its own policy after every wait
    # Without SCHED_BATCH sleeps nearly every post was preempted by the peer it woke, which ran its
    # 3 ms of work before isend returned (median 3.0 ms, 36 of 40 preempted). The behaviour under
    # test is that the woken peer does not run before the post returns: counted on the clock both
    # read, so that another job preempting rank 0 (a loaded machine) does not count, as it would in
    # the involuntary context switches (reported beside). How long a post takes is the benchmark's
    # to report (python tests/_shm_posting.py).
    peer_first = sum(woke < returned for woke, returned in zip(receiver["woke"], sender["returned"]))
    walls_ms = [w * 1e3 for w in sender["walls"]]
    assert peer_first <= count // 4, (peer_first, sender["preempted"], walls_ms)


def test_sleeping_peer_without_batch_sleeps_counts_no_batch_sleep(tmp_path):
    """batch_while_sleeping=False: plain sleeps (the behaviour before the option), said so."""
    result = run_ranks(_sleeping_peer_worker, 2, tmp_path, 4, {"batch_while_sleeping": False},
                       timeout_s=120)
    receiver = result[1]
    assert receiver["stats"]["sleeps"] > 0 and receiver["stats"]["sleeps_as_batch"] == 0, receiver["stats"]
    assert receiver["fallback"] == "disabled (ShmConfig.batch_while_sleeping=False)"
    assert receiver["policy"] == os.SCHED_OTHER


# ---------------------------------------------------------------------------------------------
# The thread's own policy and nice value survive waits; other policies are left alone; a refused
# sched_setscheduler turns the switch off with the reason, and waits still work.

def _block_sched_setscheduler() -> None:
    """sched_setscheduler fails with EPERM in this thread from now on, as under a seccomp profile
    that refuses it."""
    block_syscall(144, 1, "sched_setscheduler")


def _policy_worker(rank, world, store, case):
    ctx = _context(rank, world, store)
    peer = 1 - rank
    report = {}
    if rank == 0:
        for tag in range(3):
            store.wait([f"waiting {tag}"])
            time.sleep(0.05)  # the peer is asleep by now
            ctx.isend(torch.full((4,), float(tag)), peer, tag)
        _finish(ctx, peer)
        return report
    tid = threading.get_native_id()
    if case == "nice":
        os.setpriority(os.PRIO_PROCESS, tid, 5)
    elif case == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif case == "refused":
        _block_sched_setscheduler()
    for tag in range(3):
        handle = ctx.irecv(peer, tag)
        store.set(f"waiting {tag}", "1")
        report[f"value {tag}"] = float(handle.wait(timeout=30)[0])
    report["policy"] = os.sched_getscheduler(0)
    report["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
    report["stats"] = ctx.post_stats()
    report["fallback"] = ctx.batch_sleep_fallback()
    _finish(ctx, peer)
    return report


@pytest.mark.parametrize("case", ["nice", "idle", "refused"])
def test_waits_keep_the_thread_policy(tmp_path, case):
    if case == "refused" and platform.machine() != "x86_64":
        pytest.skip("the seccomp filter knows the x86_64 syscall number only")
    report = run_ranks(_policy_worker, 2, tmp_path, case, timeout_s=120)[1]
    assert [report[f"value {tag}"] for tag in range(3)] == [0.0, 1.0, 2.0]
    stats = report["stats"]
    assert stats["sleeps"] >= 3, stats
    if case == "nice":
        assert report["policy"] == os.SCHED_OTHER and report["nice"] == 5
        assert stats["sleeps_as_batch"] == stats["sleeps"], stats
        assert report["fallback"] == ""
    elif case == "idle":  # not SCHED_OTHER: not ours to change
        assert report["policy"] == os.SCHED_IDLE
        assert stats["sleeps_as_batch"] == 0, stats
        assert report["fallback"] == ""
    else:  # refused once, with the call and the reason, then not tried again; waits unaffected
        assert report["policy"] == os.SCHED_OTHER
        assert stats["sleeps_as_batch"] == 0, stats
        assert report["fallback"].startswith("sched_setscheduler(thread "), report["fallback"]
        assert "SCHED_BATCH) failed: Operation not permitted (errno 1)" in report["fallback"]


# ---------------------------------------------------------------------------------------------
# The reproduction runs (both orders, a shared CPU), its counters add up.

@pytest.mark.parametrize("order", ["1f1b", "dpp"])
def test_posting_reproduction_runs(tmp_path, order):
    result = posting_round(tmp_path, order, "shared", True, iterations=2, microbatches=4, scale=0.2)
    for rank in (0, 1):
        stats = result[rank]["stats"]
        assert stats["sends_posted"] == len(result[rank]["walls"]) == 4
        # Each post is written at once or queued (and maybe written by a later post to that peer).
        assert stats["written_at_post"] <= 4 <= stats["written_at_post"] + stats["queued_at_post"]
        assert stats["post_ns"] >= stats["wake_ns"]
