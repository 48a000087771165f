"""`inv rdma-test`'s pairing, judging and runs (railyard.checks.links, railyard.verbs.rdma_test) against scripted
hosts whose perftest prints real captures (tests/fixtures/real/perftest/, ORIGINS.md): what is proven is that the
verb pairs, flags and judges as documented, on the real tool's formats; the lab's stand-in and
tests/test_lab_rdma_test.py run it over real TCP between lab hosts."""

from __future__ import annotations

import re
import shlex

import pytest

from railyard.checks.links import GPU, HOST, LAT, BW, Limits, Measure, Pair, judge, rounds
from railyard.errors import UsageError
from railyard.inventory import load_inventory
from railyard.testing import FakeSession
from railyard.verbs import rdma_test as R

from .conftest import real
from .test_plan import STATIONS

BW_CLIENT = real("perftest/csegpu_cx7-ndr400_ib_write_bw_gbits_client.txt")     # 392.34 Gb/s average
LAT_CLIENT = real("perftest/csegpu_cx7-ndr400_ib_send_lat_client.txt")           # 1.27 us average
REFUSED = real("perftest/perftest-228_write_bw_client_couldnt_connect.txt")
GIDS = real("show_gids/tpgds-aihub0001_mlx5_0_v1v2.txt")


def test_pairs_are_one_pair_a_ring_in_rounds_without_a_shared_host_or_a_loopback():
    assert rounds(["A"]) == [[Pair("A", "A")]]
    assert rounds(["A", "B"]) == [[Pair("B", "A")]]
    for n in (3, 5, 24):
        hosts = [f"h{i}" for i in range(n)]
        got = rounds(hosts)
        pairs = [p for r in got for p in r]
        assert len(pairs) == n and len(got) == (2 if n % 2 == 0 else 3)          # O(N), never a mesh
        assert sorted(p.server for p in pairs) == sorted(hosts) == sorted(p.client for p in pairs)
        for r in got:
            seen = [h for p in r for h in (p.server, p.client)]
            assert len(seen) == len(set(seen)), r                                  # a round's pairs run at once


def m(gbps=None, lat=None, memory=HOST, test=BW, together=False, expected=400.0, error=""):
    return Measure(Pair("B", "A"), "cx8r0", "mlx5_0", "mlx5_0", memory, test, together, expected, gbps, lat, error)


def test_bandwidth_is_judged_against_the_slower_ends_rate_and_a_missing_row_fails_naming_the_tools_line():
    lim = Limits()
    ok = judge(m(392.34), lim)
    assert ok.status == "pass" and ok.detail == "392.3 Gb/s of 400 Gb/s (0.98)"
    slow = judge(m(160.0), lim)
    assert slow.status == "fail" and slow.detail == "160.0 Gb/s of 400 Gb/s (0.40), below 0.75 of the link's rate"
    assert judge(m(160.0, together=True), lim).status == "warn"          # all rails at once: a host limit, not a link
    assert judge(m(390.0, expected=None), lim).status == "warn"          # no rate read: not judged against it
    none = judge(m(error="client on A: Couldn't connect to 192.168.100.2:18515"), lim)
    assert none.status == "fail" and none.detail == ("no bandwidth row: client on A: Couldn't connect to "
                                                     "192.168.100.2:18515")
    gpu = judge(m(300.0, memory=GPU), lim, host_figure=392.34)
    assert gpu.status == "fail" and "0.76 of host memory's 392.3 Gb/s, below 0.8" in gpu.detail
    assert judge(m(380.0, memory=GPU), lim, host_figure=392.34).status == "pass"
    assert judge(m(lat=1.27, test=LAT), lim).detail == "1.27 us average latency"
    assert judge(m(lat=25.0, test=LAT), lim).status == "fail"


def scripted(client_for, gids=GIDS, rate="sysfs: 400 Gb/sec (4X NDR)", tools="ib_write_bw\nib_write_lat\n"):
    """Two stations whose perftest prints real captures: client_for(script) gives the client's text."""
    inv = load_inventory(STATIONS)
    ips = {h.name: h.rails["cx8r0"].ip for h in inv.hosts}
    sessions = {}
    for h in inv.hosts:
        s = FakeSession(h)

        def reply(script: str, name=h.name) -> tuple[int, str]:
            token = re.search(r"^T='?([^'\n]+)'?$", script, re.M).group(1)
            out = []
            for key in re.findall(r"^ry (\S+) \d+ ", script, re.M):
                if key == "tools":
                    text = tools
                elif key.startswith("rate."):
                    text = rate
                elif key.startswith("gids."):
                    text = gids.replace("10.99.91.39", ips[name])
                elif key.startswith("c"):
                    text = client_for(script)
                elif key.startswith("s"):
                    text = "up\n"
                else:
                    text = "************************************\n* Waiting for client to connect... *\n"
                out += [f"{token} {key}|{ln}" for ln in text.splitlines()] + [f"{token} {key}|@@rc=0"]
            return 0, "\n".join(out) + "\n"
        s.on(re.compile(r"^T="), reply)
        sessions[h.name] = s
    return inv, sessions


def perftest_lines(session: FakeSession) -> list[list[str]]:
    """The perftest commands a host ran (server or client), as argv."""
    out = []
    for c in session.calls:
        for body in re.findall(r"^ry \S+ \d+ (.*) &$", c, re.M):
            text = shlex.split(body)[0]
            for w in re.findall(r"(ib_write_(?:bw|lat) [^<>$;]*?)(?: <| >| 2>|\)|$)", text):
                out.append(shlex.split(w))
    return out


def test_two_stations_one_rail_measured_with_the_same_flags_on_both_ends_and_judged():
    inv, sessions = scripted(lambda script: LAT_CLIENT if "ib_write_lat" in script else BW_CLIENT)
    t = R.rdma_test(inv, rails="cx8r0", duration=3, sessions=sessions)
    assert [(x.test, x.memory, x.together, x.status) for x in t.measures] == [("bw", "host", False, "pass"),
                                                                              ("lat", "host", False, "pass")]
    assert t.measures[0].gbps == 392.34 and t.measures[1].lat_us == 1.27
    server, client = perftest_lines(sessions["B"]), perftest_lines(sessions["A"])
    bw_server, bw_client = server[0], client[0]
    assert bw_client[:-1] == bw_server and bw_client[-1] == "192.168.100.2"       # same flags, the server's rail IP
    assert bw_server == ["ib_write_bw", "-d", "mlx5_0", "-F", "-p", "18515", "--report_gbits", "-D", "3", "-q", "4",
                         "-s", "1048576", "-x", "3"]
    doc = R.link_report(t)
    assert doc.ok and [c.check for c in doc.checks] == ["rdma_bw", "rdma_lat"]


def test_a_peer_that_never_serves_fails_with_the_clients_own_line_and_a_missing_perftest_says_how_to_get_it():
    inv, sessions = scripted(lambda script: REFUSED)
    t = R.rdma_test(inv, rails="cx8r0", duration=3, sessions=sessions)
    assert {x.status for x in t.measures} == {"fail"}
    assert t.measures[0].error.startswith("client on A: Couldn't connect to 192.168.125.211:18515 / Unable to open")
    inv, sessions = scripted(lambda script: BW_CLIENT, tools="")
    t = R.rdma_test(inv, rails="cx8r0", sessions=sessions)
    assert not t.measures and not R.link_report(t).ok
    assert any("apt-get install perftest" in c.detail for c in t.checks)


def test_bad_flags_are_one_line_usage_errors():
    inv = load_inventory(STATIONS)
    with pytest.raises(UsageError, match=r"--rails 'cx8r9': A has no rail 'cx8r9'"):
        R.selected(inv, None, "cx8r9", "host")
    with pytest.raises(UsageError, match="--memory 'vram': must be host, gpu or both"):
        R.selected(inv, None, None, "vram")
