"""RDMA link qualification (`inv rdma-test`), the pure half: which host pairs test each other, in which
rounds, and how one perftest result is judged against the link it ran on.

Pairs: two hosts test each other once; three or more form a ring (each host a server for its
predecessor and a client of its successor: every rail of every host measured from both sides with N
pairs, never the N*(N-1)/2 of a full mesh). The ring is cut into rounds whose pairs share no host, so a
round's pairs run at once (two rounds for an even count, three for an odd one). One host alone tests
each NIC in loopback (its own rail address), all NICs at once.

The verdicts, each naming host pair, rail, HCA, memory kind and figure:
  bandwidth   ib_write_bw's average (the client's row) against the link's rate, the slower end's (sysfs
              `rate`, else `ibstat`): fail below `rdma_test_min_fraction` (0.75 by default: sparkrun's
              `setup rdma-test` warns below 0.75 of the sysfs rate). A rail measured alone is judged so;
              the same rail in the run with every rail at once only warns (a host that cannot drive all
              its rails at line rate has a PCIe or CPU limit, not a bad link).
  GPU memory  its figure against the same link's host-memory figure: fail below `rdma_test_min_gpu_ratio`
              (0.8 by default; Azure's `check_ib_bw_gdr` asks 360 Gb/s of 400G NDR in GPU memory, 0.9 of the
              line, and host memory itself reads about 0.95): a GPU-NIC path through the root complex (ACS
              redirect) or without peer memory shows here.
  latency     ib_write_lat's average against `rdma_test_max_lat_us` (10 us by default: a RoCE hop through
              one switch reads 2-5 us; ten is a link that is wrong, not a slow switch).
  no result   a run that printed no result row fails, with the tool's own error line: never a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import FAIL, PASS, WARN

HOST, GPU = "host", "gpu"
BW, LAT = "bw", "lat"


@dataclass(frozen=True)
class Pair:
    """Server and client of one perftest pair (the same host for a loopback test)."""
    server: str
    client: str

    @property
    def name(self) -> str:
        return f"{self.client}->{self.server}" if self.server != self.client else f"{self.server} loopback"


def rounds(hosts: list[str]) -> list[list[Pair]]:
    """The pairs, in rounds whose pairs share no host. One host: itself (loopback). Two: one pair. More: a
    ring, the client of each pair the server's predecessor."""
    if len(hosts) == 1:
        return [[Pair(hosts[0], hosts[0])]]
    if len(hosts) == 2:
        return [[Pair(hosts[1], hosts[0])]]
    ring = [Pair(hosts[(i + 1) % len(hosts)], hosts[i]) for i in range(len(hosts))]
    out = [ring[0:len(ring) - len(ring) % 2:2], ring[1:len(ring) - len(ring) % 2:2]]
    if len(ring) % 2:
        out.append([ring[-1]])
    return out


@dataclass(frozen=True)
class Limits:
    min_fraction: float = 0.75
    min_gpu_ratio: float = 0.8
    max_lat_us: float = 10.0


@dataclass
class Measure:
    """One perftest run of one pair on one rail: what was asked, what the client's row said."""
    pair: Pair
    rail: str                    # the rail netdev
    hca: str                     # the server's HCA on that rail (the client's in `client_hca`)
    client_hca: str
    memory: str                  # host | gpu
    test: str                    # bw | lat
    together: bool               # run while every selected rail of the pair ran
    expected_gbps: float | None  # the slower end's rate; None where neither end's was read
    gbps: float | None = None
    lat_us: float | None = None
    error: str = ""              # the tool's own failure line, or why there is no row
    cuda: tuple[int | None, int | None] = (None, None)   # (server GPU, client GPU) for GPU memory
    status: str = ""
    detail: str = ""

    @property
    def where(self) -> str:
        hcas = self.hca if self.hca == self.client_hca else f"{self.client_hca}/{self.hca}"
        mem = "GPU memory" + (f" (GPU {self.cuda[1]}/{self.cuda[0]})" if self.cuda != (None, None) else "") \
            if self.memory == GPU else "host memory"
        return f"{self.pair.name} {self.rail} ({hcas}), {mem}{', all rails at once' if self.together else ''}"


def judge(m: Measure, limits: Limits, host_figure: float | None = None) -> Measure:
    """Set m's status and detail. host_figure: the same pair and rail's host-memory bandwidth (for GPU runs)."""
    if m.test == LAT:
        if m.lat_us is None:
            return _set(m, FAIL, f"no latency row: {m.error or 'the tool printed none'}")
        if m.lat_us > limits.max_lat_us:
            return _set(m, FAIL, f"{m.lat_us:.2f} us average latency, over the {limits.max_lat_us:g} us limit")
        return _set(m, PASS, f"{m.lat_us:.2f} us average latency")
    if m.gbps is None:
        return _set(m, FAIL, f"no bandwidth row: {m.error or 'the tool printed none'}")
    figure = f"{m.gbps:.1f} Gb/s"
    if m.expected_gbps is None:
        return _set(m, WARN, f"{figure}; the link's rate was not read on either end: not judged against it")
    frac = m.gbps / m.expected_gbps
    said = f"{figure} of {m.expected_gbps:g} Gb/s ({frac:.2f})"
    if m.memory == GPU and host_figure:   # the link itself is judged by host memory: GPU memory's own cause first
        ratio = m.gbps / host_figure
        if ratio < limits.min_gpu_ratio:
            return _set(m, WARN if m.together else FAIL,
                        f"{said}; {ratio:.2f} of host memory's {host_figure:.1f} Gb/s, below "
                        f"{limits.min_gpu_ratio:g}: the GPU-NIC path is slow (ACS redirect, peer memory)")
        said += f"; {ratio:.2f} of host memory"
    if frac < limits.min_fraction:
        return _set(m, WARN if m.together else FAIL,
                    f"{said}, below {limits.min_fraction:g} of the link's rate"
                    + ("; the rail alone reads as its own row" if m.together else ""))
    return _set(m, PASS, said)


def _set(m: Measure, status: str, detail: str) -> Measure:
    m.status, m.detail = status, detail
    return m


def expected(rates: dict[str, float | None]) -> float | None:
    """The rate a pair's link runs at: the slower end's of those read."""
    known = [r for r in rates.values() if r]
    return min(known) if known else None
