"""The job's key: a secret every rank of one job holds and no one outside it, which authenticates
each heartbeat datagram (an HMAC), so that a process that can send datagrams from a forged address
still cannot forge a beat or a bye.

The key never travels through the rendezvous store, which any process that reaches its port can
read. It comes in the environment, as DPP_JOB_KEY (hex, at least 32 digits = 16 bytes):
- on one node, megatron_dpp.rank_launcher draws one for every job that has none;
- under SLURM, run_slurm_*.sh draws one before srun, which hands it to every node;
- across nodes started by hand (run_master_*.sh, run_worker_*.sh), the user gives every node's
  launcher the same one (`export DPP_JOB_KEY=$(python -m megatron_dpp.comm.job_key new)` once,
  then the same value on each node). Without one, heartbeats are checked by the sender's address
  and sequence only, and a line at start says so.
What the store does hold is the key's check value (an HMAC of a fixed text): a rank whose key
differs from a peer's is then named at start, in one line, instead of being lost 15 s later.
Standard library only: the launcher and the heartbeat helper use it.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
from typing import Mapping, Optional

JOB_KEY_ENV = "DPP_JOB_KEY"
MIN_KEY_HEX_DIGITS = 32  # 128 bits
NEW_KEY_BYTES = 32
MAC_BYTES = 16
"""A datagram's HMAC-SHA256, cut to 128 bits (as IPsec and TLS cut theirs)."""
_CHECK_TEXT = b"megatron-dpp job key check"


def job_key_problem(environ: Mapping[str, str]) -> Optional[str]:
    """One line saying what is wrong with DPP_JOB_KEY in `environ`, or None (unset counts as fine:
    heartbeats then run unauthenticated, saying so)."""
    text = environ.get(JOB_KEY_ENV)
    if text is None:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return (f"{JOB_KEY_ENV} must be hexadecimal digits (e.g. from `python -m "
                f"megatron_dpp.comm.job_key new`), got {len(text)} characters that are not")
    if len(key) * 2 < MIN_KEY_HEX_DIGITS:
        return (f"{JOB_KEY_ENV} holds {len(key) * 2} hexadecimal digits; a job key needs at least "
                f"{MIN_KEY_HEX_DIGITS} (`python -m megatron_dpp.comm.job_key new` makes one)")
    return None


def job_key(environ: Mapping[str, str]) -> Optional[bytes]:
    """The key DPP_JOB_KEY holds, or None when it is unset. Raises ValueError (job_key_problem's
    line) when it is malformed."""
    problem = job_key_problem(environ)
    if problem is not None:
        raise ValueError(problem)
    text = environ.get(JOB_KEY_ENV)
    return None if text is None else bytes.fromhex(text)


def new_job_key() -> str:
    """A fresh key, as DPP_JOB_KEY holds it."""
    return secrets.token_hex(NEW_KEY_BYTES)


def key_check(key: Optional[bytes]) -> str:
    """What a rank publishes about its key: a value that tells whether two ranks hold the same key
    and says nothing about the key itself; "" without one."""
    if key is None:
        return ""
    return hmac.new(key, _CHECK_TEXT, hashlib.sha256).hexdigest()[:16]


class DatagramSeal:
    """Seals a datagram for one receiver with the job's key, and opens what a peer sealed for this
    rank. The receiver's rank is part of what the MAC covers (it is not sent): a datagram a peer
    sealed for another rank does not open here."""

    def __init__(self, key: bytes):
        if not key:
            raise ValueError("a DatagramSeal needs a key")
        self._mac = hmac.new(key, digestmod=hashlib.sha256)

    def _tag(self, body: bytes, receiver: int) -> bytes:
        mac = self._mac.copy()  # the key's padding is hashed once, here a copy per datagram
        mac.update(body)
        mac.update(receiver.to_bytes(4, "big"))
        return mac.digest()[:MAC_BYTES]

    def seal(self, body: bytes, receiver: int) -> bytes:
        return body + self._tag(body, receiver)

    def opened(self, data: bytes, receiver: int) -> Optional[bytes]:
        """The body of `data` if its tag is right for `receiver`, else None."""
        if len(data) <= MAC_BYTES:
            return None
        body, tag = data[:-MAC_BYTES], data[-MAC_BYTES:]
        return body if hmac.compare_digest(tag, self._tag(body, receiver)) else None


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m megatron_dpp.comm.job_key new`: print a fresh key for DPP_JOB_KEY."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["new"]:
        print("usage: python -m megatron_dpp.comm.job_key new   (prints a fresh DPP_JOB_KEY)",
              file=sys.stderr)
        return 2
    print(new_job_key())
    return 0


if __name__ == "__main__":
    sys.exit(main())
