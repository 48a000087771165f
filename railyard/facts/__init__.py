"""Facts about a host, by domain: each fact's command (the `Section` a probe script runs, railyard.facts.probe)
beside its pure parser (tool output text -> typed values, no I/O), as pyinfra's facts put `command` and `process`
side by side.

    facts.net     the rail: ibdev2netdev, ip addr/link, route get, ethtool and its counters, ping, show_gids,
                  ssh and TCP ports between the hosts
    facts.gpu     nvidia-smi's queries and topology, lscpu's NUMA nodes, NVIDIA Xid lines
    facts.system  the clock (timedatectl, chronyc), df/du, versions, kernel modules, ibv_devinfo, lspci
    facts.docker  docker version, image and container inspect, logs
    facts.probe   many sections run in one round trip; facts.host: what a plan needs of each host

Each parser is tested on real captured output in tests/fixtures/real/.
"""

from __future__ import annotations


class ParseError(ValueError):
    """The text is not what the tool prints."""

