"""The fake CUDA runtime (csrc/fake_cudart, built as shm_tensor/_fake_cudart*.so) on its own, through
ctypes: the CUDA entry points shm_tensor resolves, with CUDA's error codes, host memory standing for
device memory, IPC memory opened by another process and copied with process_vm_readv/writev, and
interprocess events whose state lives in /dev/shm. test_shm_cuda_protocol.py runs the transport on it.

Imports here are stdlib only (shm_tensor, hence torch, only inside `_library_path`), so the spawned
processes of the two-process test start fast."""
from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import struct
import subprocess
import sys
import threading
import traceback

import pytest

SUCCESS = 0
INVALID_VALUE = 1
INVALID_DEVICE = 101
DEVICE_UNINITIALIZED = 201
INVALID_RESOURCE_HANDLE = 400
NOT_READY = 600
LAUNCH_FAILURE = 719
EVENT_DISABLE_TIMING = 0x02
EVENT_INTERPROCESS = 0x04
MEMCPY_DEFAULT = 4


class Handle(ctypes.Structure):
    """cudaIpcMemHandle_t / cudaIpcEventHandle_t: 64 opaque bytes, passed by value to the Open calls."""
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _raw(handle: Handle) -> bytes:
    """All 64 bytes (the c_char array's value would stop at the first NUL)."""
    return ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))


def _library_path() -> str:
    import shm_tensor

    return shm_tensor.fake_cudart_path()


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    void_pp = ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "cudaGetDevice": [ctypes.POINTER(ctypes.c_int)],
        "cudaSetDevice": [ctypes.c_int],
        "cudaMalloc": [void_pp, ctypes.c_size_t],
        "cudaFree": [ctypes.c_void_p],
        "cudaIpcGetMemHandle": [ctypes.POINTER(Handle), ctypes.c_void_p],
        "cudaIpcOpenMemHandle": [void_pp, Handle, ctypes.c_uint],
        "cudaIpcCloseMemHandle": [ctypes.c_void_p],
        "cudaStreamCreateWithFlags": [void_pp, ctypes.c_uint],
        "cudaStreamDestroy": [ctypes.c_void_p],
        "cudaStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint],
        "cudaMemcpyAsync": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p],
        "cudaEventCreateWithFlags": [void_pp, ctypes.c_uint],
        "cudaEventDestroy": [ctypes.c_void_p],
        "cudaEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
        "cudaEventQuery": [ctypes.c_void_p],
        "cudaIpcGetEventHandle": [ctypes.POINTER(Handle), ctypes.c_void_p],
        "cudaIpcOpenEventHandle": [void_pp, Handle],
        "cudaGetErrorString": [ctypes.c_int],
        "cuMemGetAddressRange_v2": [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_size_t),
                                    ctypes.c_ulonglong],
        "fake_cudart_is_fake": [],
        "fake_cudart_count": [ctypes.c_char_p],
        "fake_cudart_reset_counts": [],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.fake_cudart_count.restype = ctypes.c_ulonglong
    lib.fake_cudart_reset_counts.restype = None
    return lib


def _error_string(lib, code: int) -> str:
    return lib.cudaGetErrorString(code).decode()


def _count(lib, name: str) -> int:
    return lib.fake_cudart_count(name.encode())


def _malloc(lib, size: int) -> int:
    pointer = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(pointer), size) == SUCCESS
    return pointer.value


def _event(lib, flags: int) -> int:
    event = ctypes.c_void_p()
    assert lib.cudaEventCreateWithFlags(ctypes.byref(event), flags) == SUCCESS
    return event.value


def _event_state_file(handle: bytes) -> str:
    """/dev/shm path of an interprocess event's state: the handle is "FAKEEVT\\0" + the shm name."""
    assert handle[:8] == b"FAKEEVT\0"
    return "/dev/shm" + handle[8:].split(b"\0", 1)[0].decode()


def _event_state(handle: bytes) -> tuple[int, int]:
    """(recorded, completed) as the event's owner wrote them into shared memory."""
    with open(_event_state_file(handle), "rb") as state:
        return struct.unpack("<QQ", state.read(16))


@pytest.fixture(scope="module")
def lib():
    return _load(_library_path())


# ---------------------------------------------------------------------------------------------
# One process


def test_it_says_it_is_fake_and_counts_calls(lib):
    assert lib.fake_cudart_is_fake() == 1
    lib.fake_cudart_reset_counts()
    event = _event(lib, 0)
    for _ in range(3):
        assert lib.cudaEventQuery(ctypes.c_void_p(event)) == SUCCESS
    assert lib.cudaEventRecord(ctypes.c_void_p(event), None) == SUCCESS
    assert _count(lib, "cudaEventQuery") == 3
    assert _count(lib, "cudaEventRecord") == 1
    assert _count(lib, "cudaEventCreateWithFlags") == 1
    assert _count(lib, "cudaMemcpyAsync") == 0
    assert _count(lib, "notAnEntryPoint") == 0
    assert lib.cudaEventDestroy(ctypes.c_void_p(event)) == SUCCESS
    lib.fake_cudart_reset_counts()
    assert _count(lib, "cudaEventQuery") == 0


def test_devices_are_per_thread_and_checked(lib):
    device = ctypes.c_int(-1)
    assert lib.cudaSetDevice(3) == SUCCESS
    assert lib.cudaGetDevice(ctypes.byref(device)) == SUCCESS and device.value == 3
    seen = []

    def other_thread():
        value = ctypes.c_int(-1)
        lib.cudaGetDevice(ctypes.byref(value))
        seen.append(value.value)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=10)
    assert seen == [0]
    assert lib.cudaSetDevice(8) == INVALID_DEVICE
    assert lib.cudaSetDevice(-1) == INVALID_DEVICE
    assert _error_string(lib, INVALID_DEVICE) == "invalid device ordinal"
    assert lib.cudaSetDevice(0) == SUCCESS


def test_malloc_free_and_address_ranges(lib):
    base = _malloc(lib, 1000)
    assert base % 256 == 0
    range_base, range_size = ctypes.c_ulonglong(), ctypes.c_size_t()
    assert lib.cuMemGetAddressRange_v2(ctypes.byref(range_base), ctypes.byref(range_size),
                                       base + 999) == SUCCESS
    assert (range_base.value, range_size.value) == (base, 1000)
    # Memory cudaMalloc did not return (a CPU tensor's): its own base, size unknown (0).
    host = ctypes.create_string_buffer(64)
    assert lib.cuMemGetAddressRange_v2(ctypes.byref(range_base), ctypes.byref(range_size),
                                       ctypes.addressof(host) + 8) == SUCCESS
    assert (range_base.value, range_size.value) == (ctypes.addressof(host) + 8, 0)
    # The host bytes are usable as device memory.
    assert lib.cudaMemcpyAsync(base, b"0123456789", 10, MEMCPY_DEFAULT, None) == SUCCESS
    assert lib.cudaMemcpyAsync(ctypes.addressof(host), base + 2, 5, MEMCPY_DEFAULT, None) == SUCCESS
    assert host.raw[:5] == b"23456"
    assert lib.cudaMemcpyAsync(None, None, 0, MEMCPY_DEFAULT, None) == SUCCESS  # n == 0
    assert lib.cudaFree(base) == SUCCESS
    assert lib.cudaFree(base) == INVALID_VALUE  # not allocated (any more)
    assert lib.cudaFree(None) == SUCCESS  # as CUDA
    assert lib.cuMemGetAddressRange_v2(ctypes.byref(range_base), ctypes.byref(range_size),
                                       base + 10) == SUCCESS
    assert (range_base.value, range_size.value) == (base + 10, 0)
    empty = ctypes.c_void_p(1)
    assert lib.cudaMalloc(ctypes.byref(empty), 0) == SUCCESS and empty.value is None


def test_streams_and_events_in_one_process(lib):
    stream = ctypes.c_void_p()
    assert lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 0x01) == SUCCESS
    event = _event(lib, EVENT_DISABLE_TIMING)
    assert lib.cudaEventQuery(event) == SUCCESS  # never recorded: complete, as CUDA
    assert lib.cudaEventRecord(event, stream) == SUCCESS
    assert lib.cudaEventQuery(event) == SUCCESS  # work is synchronous
    assert lib.cudaStreamWaitEvent(stream, event, 0) == SUCCESS
    assert lib.cudaStreamWaitEvent(stream, None, 0) == INVALID_RESOURCE_HANDLE
    handle = Handle()
    # As CUDA: only cudaEventInterprocess events have IPC handles.
    assert lib.cudaIpcGetEventHandle(ctypes.byref(handle), event) == INVALID_RESOURCE_HANDLE
    assert lib.cudaEventDestroy(event) == SUCCESS
    # A destroyed event is an error, not a crash.
    assert lib.cudaEventDestroy(event) == INVALID_RESOURCE_HANDLE
    assert lib.cudaEventQuery(event) == INVALID_RESOURCE_HANDLE
    assert lib.cudaEventRecord(event, None) == INVALID_RESOURCE_HANDLE
    assert lib.cudaStreamDestroy(stream) == SUCCESS
    assert lib.cudaStreamDestroy(stream) == INVALID_RESOURCE_HANDLE
    assert _error_string(lib, INVALID_RESOURCE_HANDLE) == "invalid resource handle"
    assert _error_string(lib, NOT_READY) == "device not ready"
    assert _error_string(lib, 12345) == "unknown fake cudart error"


def test_interprocess_event_state_is_shared_and_unlinked(lib):
    owner = _event(lib, EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
    opened = ctypes.c_void_p()
    handle = Handle()
    try:
        assert lib.cudaIpcGetEventHandle(ctypes.byref(handle), owner) == SUCCESS
        raw = _raw(handle)
        state_file = _event_state_file(raw)
        assert oct(os.stat(state_file).st_mode & 0o777) == oct(0o600)
        assert lib.cudaIpcOpenEventHandle(ctypes.byref(opened), handle) == SUCCESS
        assert lib.cudaEventRecord(owner, None) == SUCCESS
        assert lib.cudaEventRecord(opened, None) == SUCCESS  # either side records the one state
        assert _event_state(raw) == (2, 2)
        # Recorded but not completed (as a real device while it works): not ready, on both sides.
        with open(state_file, "r+b") as state_fd, mmap.mmap(state_fd.fileno(), 16) as state:
            state[:8] = struct.pack("<Q", 3)
            assert lib.cudaEventQuery(opened) == NOT_READY
            assert lib.cudaEventQuery(owner) == NOT_READY
            state[:8] = struct.pack("<Q", 2)
        assert lib.cudaEventQuery(opened) == SUCCESS
        assert lib.cudaEventDestroy(owner) == SUCCESS
        owner = None
        assert not os.path.exists(state_file)  # the owner unlinked the name
        assert lib.cudaEventQuery(opened) == SUCCESS  # the opener's mapping still holds the state
    finally:  # nothing left in /dev/shm when an assertion fails
        if owner is not None:
            lib.cudaEventDestroy(owner)
        if opened.value is not None:
            assert lib.cudaEventDestroy(opened) == SUCCESS
    # The name is gone: the handle opens nothing any more.
    assert lib.cudaIpcOpenEventHandle(ctypes.byref(opened), handle) == INVALID_RESOURCE_HANDLE
    assert lib.cudaIpcOpenEventHandle(ctypes.byref(opened), Handle()) == INVALID_VALUE  # no magic


def test_own_memory_handle_is_refused(lib):
    base = _malloc(lib, 4096)
    handle = Handle()
    assert lib.cudaIpcGetMemHandle(ctypes.byref(handle), None) == INVALID_VALUE
    assert lib.cudaIpcGetMemHandle(ctypes.byref(handle), base) == SUCCESS
    assert _raw(handle)[:8] == b"FAKEMEM\0"
    opened = ctypes.c_void_p()
    assert lib.cudaIpcOpenMemHandle(ctypes.byref(opened), handle, 1) == DEVICE_UNINITIALIZED
    assert lib.cudaIpcOpenMemHandle(ctypes.byref(opened), Handle(), 1) == INVALID_VALUE
    assert lib.cudaIpcCloseMemHandle(base) == INVALID_VALUE  # never opened
    assert lib.cudaFree(base) == SUCCESS


def test_refuse_export_of_memory_cudamalloc_did_not_return(lib, monkeypatch):
    """FAKE_CUDART_REFUSE_EXPORT stands for torch's expandable segments, which CUDA cannot export."""
    base = _malloc(lib, 4096)
    host = ctypes.create_string_buffer(64)
    handle = Handle()
    monkeypatch.setenv("FAKE_CUDART_REFUSE_EXPORT", "1")
    assert lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.addressof(host)) == INVALID_VALUE
    assert lib.cudaIpcGetMemHandle(ctypes.byref(handle), base + 64) == SUCCESS
    monkeypatch.delenv("FAKE_CUDART_REFUSE_EXPORT")
    assert lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.addressof(host)) == SUCCESS
    assert lib.cudaFree(base) == SUCCESS


@pytest.mark.timeout(60)
def test_copy_delay_stands_for_a_slow_copy():
    """FAKE_CUDART_COPY_DELAY_US is read once per process, so in a fresh one."""
    code = (
        "import ctypes, sys, time\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, "
        "ctypes.c_void_p]\n"
        "out = ctypes.create_string_buffer(8)\n"
        "start = time.monotonic()\n"
        "assert lib.cudaMemcpyAsync(ctypes.addressof(out), b'abcdefgh', 8, 4, None) == 0\n"
        "assert out.raw == b'abcdefgh'\n"
        "print(time.monotonic() - start)\n"
    )
    env = dict(os.environ, FAKE_CUDART_COPY_DELAY_US="300000")
    result = subprocess.run([sys.executable, "-c", code, _library_path()], capture_output=True,
                            text=True, timeout=50, env=env)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) >= 0.3


@pytest.mark.timeout(60)
def test_event_names_of_dead_owners_are_removed():
    """A process that died without destroying its interprocess events leaves their names in /dev/shm;
    the next process's first interprocess event removes them (once per process, so in a fresh one)."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, timeout=30)
    dead = f"/dev/shm/fake_cudart_ev_{int(gone.stdout)}_0"
    alive = f"/dev/shm/fake_cudart_ev_{os.getpid()}_999999"
    code = (
        "import ctypes, sys\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "event = ctypes.c_void_p()\n"
        "assert lib.cudaEventCreateWithFlags(ctypes.byref(event), 4) == 0\n"
        "assert lib.cudaEventDestroy(event) == 0\n"
    )
    try:
        for path in (dead, alive):
            with open(path, "wb") as stale:
                stale.write(bytes(16))
        result = subprocess.run([sys.executable, "-c", code, _library_path()], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert not os.path.exists(dead)
        assert os.path.exists(alive)  # its owner (this process) lives
    finally:
        for path in (dead, alive):
            if os.path.exists(path):
                os.unlink(path)


# ---------------------------------------------------------------------------------------------
# Two processes: A exports a buffer and an interprocess event, B (a sibling, as ranks are) opens them.

PATTERN = bytes(range(256)) * 16  # 4 KiB
WAIT_S = 30


def _receive(connection, expected: str):
    if not connection.poll(WAIT_S):
        raise TimeoutError(f"no {expected!r} message within {WAIT_S} s")
    message = connection.recv()
    if message[0] != expected:
        raise RuntimeError(f"expected {expected!r}, got {message!r}")
    return message


def _exporter(path: str, to_b, results) -> None:
    """Process A."""
    try:
        lib = _load(path)
        base = _malloc(lib, len(PATTERN))
        ctypes.memmove(base, PATTERN, len(PATTERN))
        memory = Handle()
        assert lib.cudaIpcGetMemHandle(ctypes.byref(memory), base) == SUCCESS
        event = _event(lib, EVENT_INTERPROCESS | EVENT_DISABLE_TIMING)
        for _ in range(3):
            assert lib.cudaEventRecord(event, None) == SUCCESS
        event_handle = Handle()
        assert lib.cudaIpcGetEventHandle(ctypes.byref(event_handle), event) == SUCCESS
        to_b.send(("handles", _raw(memory), _raw(event_handle)))
        _receive(to_b, "written")
        to_b.send(("buffer", ctypes.string_at(base, 64)))
        for _ in range(2):
            assert lib.cudaEventRecord(event, None) == SUCCESS
        to_b.send(("recorded",))
        _receive(to_b, "bye")
        assert lib.cudaEventDestroy(event) == SUCCESS  # unlinks its name; B keeps its mapping
        results.put(("A", "ok", os.getpid()))
    except BaseException:
        results.put(("A", "error", traceback.format_exc()))


def _opener(path: str, to_a, from_parent, results) -> None:
    """Process B: what it observed goes to the parent, which asserts."""
    try:
        lib = _load(path)
        seen = {}
        _, memory_raw, event_raw = _receive(to_a, "handles")
        memory, event_handle = Handle(), Handle()
        ctypes.memmove(ctypes.addressof(memory), memory_raw, 64)
        ctypes.memmove(ctypes.addressof(event_handle), event_raw, 64)
        opened = ctypes.c_void_p()
        seen["open_memory"] = lib.cudaIpcOpenMemHandle(ctypes.byref(opened), memory, 1)
        opened_event = ctypes.c_void_p()
        seen["open_event"] = lib.cudaIpcOpenEventHandle(ctypes.byref(opened_event), event_handle)
        local = _malloc(lib, len(PATTERN))
        seen["copy_in"] = lib.cudaMemcpyAsync(local, opened, len(PATTERN), MEMCPY_DEFAULT, None)
        seen["copied_equal"] = ctypes.string_at(local, len(PATTERN)) == PATTERN
        seen["copy_offset"] = lib.cudaMemcpyAsync(local, opened.value + 100, 50, MEMCPY_DEFAULT, None)
        seen["copied_offset"] = ctypes.string_at(local, 50) == PATTERN[100:150]
        seen["copy_out"] = lib.cudaMemcpyAsync(opened.value + 8, b"\xab" * 16, 16, MEMCPY_DEFAULT, None)
        seen["state_before"] = _event_state(event_raw)
        seen["query_before"] = lib.cudaEventQuery(opened_event)
        to_a.send(("written",))
        seen["a_buffer"] = _receive(to_a, "buffer")[1]
        _receive(to_a, "recorded")
        seen["state_after"] = _event_state(event_raw)
        seen["query_after"] = lib.cudaEventQuery(opened_event)
        seen["wait_event"] = lib.cudaStreamWaitEvent(None, opened_event, 0)
        to_a.send(("bye",))
        _receive(from_parent, "a_gone")
        seen["state_file_a_gone"] = os.path.exists(_event_state_file(event_raw))
        seen["query_a_gone"] = lib.cudaEventQuery(opened_event)  # B's mapping outlives A
        seen["copy_a_gone"] = lib.cudaMemcpyAsync(local, opened, 64, MEMCPY_DEFAULT, None)
        seen["copy_a_gone_error"] = _error_string(lib, LAUNCH_FAILURE)
        seen["write_a_gone"] = lib.cudaMemcpyAsync(opened, local, 64, MEMCPY_DEFAULT, None)
        seen["write_a_gone_error"] = _error_string(lib, LAUNCH_FAILURE)
        seen["close_memory"] = lib.cudaIpcCloseMemHandle(opened)
        seen["close_memory_again"] = lib.cudaIpcCloseMemHandle(opened)
        seen["destroy_event"] = lib.cudaEventDestroy(opened_event)
        seen["counts"] = {name: _count(lib, name) for name in (
            "cudaIpcOpenMemHandle", "cudaIpcOpenEventHandle", "cudaMemcpyAsync", "cudaEventQuery",
            "cudaStreamWaitEvent", "cudaEventRecord")}
        results.put(("B", "ok", seen))
    except BaseException:
        results.put(("B", "error", traceback.format_exc()))


@pytest.mark.timeout(120)
def test_two_processes_share_memory_and_events():
    path = _library_path()
    context = multiprocessing.get_context("spawn")
    a_end, b_end = context.Pipe()
    parent_end, b_control = context.Pipe()
    results = context.Queue()
    a = context.Process(target=_exporter, args=(path, a_end, results))
    b = context.Process(target=_opener, args=(path, b_end, b_control, results))
    try:
        a.start()
        b.start()
        # A reports first (B waits for "a_gone"), unless one of them failed.
        who, status, value = results.get(timeout=WAIT_S * 2)
        assert (who, status) == ("A", "ok"), f"{who}: {value}"
        a_pid = value
        a.join(timeout=WAIT_S)  # reaped: its pid names no process any more
        assert a.exitcode == 0
        parent_end.send(("a_gone",))
        who, status, seen = results.get(timeout=WAIT_S * 2)
        assert (who, status) == ("B", "ok"), seen
        b.join(timeout=WAIT_S)
    finally:
        for process in (a, b):
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        # A failed A never destroyed its event: its name would stay in /dev/shm.
        for name in os.listdir("/dev/shm"):
            if a.pid is not None and name.startswith(f"fake_cudart_ev_{a.pid}_"):
                os.unlink(os.path.join("/dev/shm", name))
    assert seen["open_memory"] == SUCCESS and seen["open_event"] == SUCCESS
    assert seen["copy_in"] == SUCCESS and seen["copied_equal"]
    assert seen["copy_offset"] == SUCCESS and seen["copied_offset"]
    assert seen["copy_out"] == SUCCESS
    assert seen["a_buffer"] == PATTERN[:8] + b"\xab" * 16 + PATTERN[24:64]  # B wrote into A
    assert seen["state_before"] == (3, 3) and seen["query_before"] == SUCCESS
    assert seen["state_after"] == (5, 5) and seen["query_after"] == SUCCESS  # A's later records
    assert seen["wait_event"] == SUCCESS
    assert not seen["state_file_a_gone"]  # A's destroy unlinked it
    assert seen["query_a_gone"] == SUCCESS
    assert seen["copy_a_gone"] == LAUNCH_FAILURE
    assert seen["copy_a_gone_error"] == (
        f"fake cudart: process_vm_readv from pid {a_pid} failed: No such process")
    assert seen["write_a_gone"] == LAUNCH_FAILURE
    assert "process_vm_writev to pid" in seen["write_a_gone_error"]
    assert seen["close_memory"] == SUCCESS and seen["close_memory_again"] == INVALID_VALUE
    assert seen["destroy_event"] == SUCCESS
    assert seen["counts"] == {
        "cudaIpcOpenMemHandle": 1, "cudaIpcOpenEventHandle": 1, "cudaMemcpyAsync": 5,
        "cudaEventQuery": 3, "cudaStreamWaitEvent": 1, "cudaEventRecord": 0}
