"""One cause, one message (issue 15): an MTU black hole on the rail is named once; real partial loss still warns.

Ping outputs are real captures (tests/fixtures/real/ping, origins in FORMATS-ORIGINS.md), put into the per-peer
blocks preflight's fan-out prints (`@@peer IP rc=N`, the small warm-up ping, the `@@jumbo` marker, the jumbo ping)."""

import ipaddress

from railyard.checks import FAIL, PASS, CheckResult
from railyard.checks.net import check_jumbo_ping, check_ssh_peer
from railyard.checks.parity import one_cause
from railyard.facts.net import JUMBO_MARK
from railyard.inventory import Host, Rail
from railyard.facts.probe import Output

from .conftest import REAL

P = REAL / "ping"
SMALL = (P / "local-lab-ping-I-c1-small-over-mtu-blackhole.txt").read_text()
SILENT = (P / "local-lab-ping-I-M-do-s8972-c3-mtu-blackhole-silent-loss.txt").read_text()
PARTIAL = (P / "local-ping-M-do-s8972-c3-tbf-partial-loss.txt").read_text()
OK = (P / "local-ping-c3-lo.txt").read_text()


def host(name, ip):
    rail = Rail(name="cx8r1", hca="mlx5_1", ipv4=ipaddress.ip_interface(f"{ip}/24"))
    return Host(name=name, rank=0, address=ip, port=22, user="root", connection="ssh", key_file="",
                rails={"cx8r1": rail}, vars={"preflight_mtu": 9000, "cluster_serve_rail": "cx8r1"})


A, B = host("A", "198.18.101.11"), host("B", "198.18.101.12")


def block(peer, small, jumbo, rc=1):
    return Output(0, f"@@peer {peer.serve_rail.ip} rc={rc}\n{small}{JUMBO_MARK}\n{jumbo}")


def test_real_partial_loss_still_warns_after_the_warm_up_ping():
    r = check_jumbo_ping(A, block(B, SMALL, PARTIAL), [B])
    assert r.status == "warn" and "1/3 received (ping: sendmsg: No buffer space available)" in r.detail
    assert check_jumbo_ping(A, block(B, SMALL, OK, rc=0), [B]).status == "pass"


def test_an_mtu_black_hole_is_named_once_and_the_rest_point_at_it():
    pings = {"A": block(B, SMALL, SILENT), "B": block(A, SMALL, SILENT)}
    per = {h.name: {"mtu": CheckResult(h.name, "mtu", PASS, "cx8r1 mtu 9000"),
                    "jumbo_ping": check_jumbo_ping(h, pings[h.name], [p for p in (A, B) if p is not h])}
           for h in (A, B)}
    per["A"]["ssh_peer"] = check_ssh_peer(A, Output(0, "@@peer 198.18.101.12 rc=124\n"), [B])
    assert "ssh hung" in per["A"]["ssh_peer"].detail
    one_cause([A, B], per, pings)
    texts = [r.detail for checks in per.values() for r in checks.values()]
    assert sum("an MTU black hole between A and B" in t for t in texts) == 1
    assert "tracepath" in per["A"]["jumbo_ping"].hint and "9216" in per["A"]["jumbo_ping"].hint
    assert "the MTU black hole named on A's jumbo_ping" in per["B"]["jumbo_ping"].detail
    assert per["A"]["ssh_peer"].detail.endswith("likely cause: the MTU black hole named on A's jumbo_ping, not SSH")


def test_a_wrong_mtu_at_one_end_is_the_cause_not_a_black_hole():
    pings = {"A": block(B, SMALL, SILENT)}
    per = {"A": {"mtu": CheckResult("A", "mtu", PASS, "cx8r1 mtu 9000"),
                 "jumbo_ping": check_jumbo_ping(A, pings["A"], [B])},
           "B": {"mtu": CheckResult("B", "mtu", FAIL, "cx8r1 mtu 1500, expected 9000")}}
    one_cause([A, B], per, pings)
    d = per["A"]["jumbo_ping"].detail
    assert "likely cause: B's MTU (cx8r1 mtu 1500, expected 9000; see B's mtu check)" in d and "black hole" not in d


def test_nothing_passing_at_all_is_not_called_an_mtu_black_hole():
    dead = SMALL.replace("1 received, 0% packet loss", "0 received, 100% packet loss")
    pings = {"A": block(B, dead, SILENT)}
    per = {"A": {"mtu": CheckResult("A", "mtu", PASS, "ok"), "jumbo_ping": check_jumbo_ping(A, pings["A"], [B])},
           "B": {"mtu": CheckResult("B", "mtu", PASS, "ok")}}
    before = per["A"]["jumbo_ping"]
    one_cause([A, B], per, pings)
    assert per["A"]["jumbo_ping"] == before
