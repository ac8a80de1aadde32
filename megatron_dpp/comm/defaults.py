"""The transport choices and defaults the command line offers, without torch: the launcher checks a
job's flags (`python -m megatron_dpp.arguments`) before it starts any rank, and importing torch for
that would add seconds to every launch, dry run and refused flag.

The router's route tables (router.py) have one row list per kind named here; it asserts so at import.
"""

# --p2p-transport values, in the order --help lists them; router.ROUTE_TABLES has one table for each.
TRANSPORT_KINDS = ("auto", "torch", "shm", "rdma")
DEFAULT_TRANSPORT_KIND = "auto"

# How long a transport wait without an explicit timeout lasts (--p2p-timeout's default).
DEFAULT_TIMEOUT_S = 300.0
