"""The two-namespace network of the tests: `two_node_network()`, `netns_skip_reason()`. One copy,
in benchmarks/netns_nodes.py, which the transport benchmark's --cross-namespace mode uses too."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from netns_nodes import TwoNodeNetwork, netns_skip_reason, two_node_network  # noqa: E402

__all__ = ["TwoNodeNetwork", "netns_skip_reason", "two_node_network"]
