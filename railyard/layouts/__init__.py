"""The serving layouts, one package each; importing this package registers every one of them
(railyard.plan.layout.Layout). A layout's package holds its plan and the hooks the generic verbs
call: its health probes, its final gate, its verify-rdma, its recover."""

from . import multinode_tp, single_node, replicas, pd  # the order serve_layout's error lists them in

__all__ = ["multinode_tp", "pd", "replicas", "single_node"]
