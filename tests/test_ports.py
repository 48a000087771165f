"""The ports a plan opens between hosts, and preflight's check of them, without the lab: the dials each
layout plans against what its own rendered commands use, scripts/port_probe.py run on this machine's
loopback (real sockets: a listener, a connect, a refusal), and the judge on both hosts' lines."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

from railyard.checks import FAIL, PASS, WARN
from railyard.checks.net import check_ports
from railyard.inventory import Host, load_inventory
from railyard.facts.net import PORT_SCRIPT, parse_port_probe, ports_section
from railyard.verbs.preflight import plan_dials
from railyard.facts.probe import Output
from railyard.render import docker
from railyard.plan.spec import Dial

from .conftest import ROOT
from .test_pd_plan import _two_host_decode, pd_plan


def host(name: str) -> Host:
    return Host(name=name, rank=0, address="127.0.0.1", port=22, user="", connection="ssh", key_file="", rails={},
                vars={})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(*args) -> str:
    return subprocess.run([sys.executable, str(PORT_SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=30).stdout


def test_two_stations_plan_the_workers_dial_to_the_heads_master_port_and_rdma_tests_perftest_ports():
    inv = load_inventory(ROOT / "inventory" / "dgx-stations.yml")
    assert plan_dials(inv) == [Dial("B", "A", "192.168.101.1", 29501, "the head's master port"),
                               Dial("A", "B", "192.168.100.2", 18515, "rdma-test's perftest on cx8r0"),
                               Dial("A", "B", "192.168.101.2", 18516, "rdma-test's perftest on cx8r1")]
    assert plan_dials(load_inventory(ROOT / "inventory" / "hgx8-h200.yml")) == []  # one host: nothing crosses


def test_pd_dials_are_the_ports_its_rendered_commands_use(tmp_path):
    inv, plan = pd_plan()
    dials = plan_dials(inv)
    router = docker.run_line(plan, plan.service("proxy"))
    apis = {f"http://{d.address}:{d.port}" for d in dials if d.what.endswith("'s API")}
    # every instance the router is given, dialed from the proxy's host where it is another host
    assert apis == set(re.findall(r"--(?:prefill|decode) (\S+)", router)) - {"http://192.168.120.11:8100",
                                                                             "http://192.168.120.11:8101"}
    for name in ("prefill-0", "prefill-3"):
        svc = plan.service(name)
        env = dict(svc.spec.env)
        base = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])   # vLLM listens on this + the rank's DP index
        ports = sorted(d.port for d in dials if d.what.startswith(f"{name}'s NIXL") and d.src == "D1")
        assert ports == list(range(base, base + 4)) and all(
            d.address == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for d in dials if d.what.startswith(name))
    wide_inv, wide = pd_plan(path=_two_host_decode(tmp_path))
    [rpc] = [d for d in plan_dials(wide_inv) if "DP RPC" in d.what]
    assert (rpc.src, rpc.dst, rpc.address, rpc.port) == ("D2", "D1", "192.168.120.13", 29550)
    assert "--data-parallel-rpc-port 29550" in docker.run_line(wide, wide.service("decode-0-node1"))


def test_each_host_listens_for_its_dialers_and_dials_its_own():
    dials = [Dial("B", "A", "10.0.0.1", 29501, "the head's master port"),
             Dial("C", "A", "10.0.0.1", 29501, "the head's master port"),
             Dial("A", "B", "10.0.0.2", 8100, "decode-0's API")]
    a = ports_section(host("A"), dials).command
    assert "listen 10.0.0.1 29501 2 dial 10.0.0.2 8100" in a
    assert "listen" not in ports_section(host("C"), dials).command.split("' ", 1)[1]
    assert ports_section(host("D"), dials) is None


def test_the_probe_connects_to_its_listener_and_reports_a_refusal_on_real_sockets():
    up, closed = free_port(), free_port()
    out = probe(2, 1, "listen", "127.0.0.1", up, 1, "dial", "127.0.0.1", up, "dial", "127.0.0.1", closed,
                "listen", "192.0.2.1", up, 1)
    listens, dials = parse_port_probe(out)
    assert listens[("127.0.0.1", up)].status == "ok" and listens[("127.0.0.1", up)].detail == "127.0.0.1"
    assert listens[("192.0.2.1", up)].status == "no-address"
    assert dials[("127.0.0.1", up)].status == "connected"
    refused = dials[("127.0.0.1", closed)]
    assert refused.status == "refused" and int(refused.detail) > 1 and refused.end - refused.start >= 1.5


def test_a_port_already_served_is_left_to_its_service_and_still_dialed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = probe(1, 1, "listen", "127.0.0.1", port, 1, "dial", "127.0.0.1", port)
    listens, dials = parse_port_probe(out)
    assert listens[("127.0.0.1", port)].status == "in-use" and dials[("127.0.0.1", port)].status == "connected"


def lines(*items: str) -> Output:
    return Output(0, "".join(i + "\n" for i in items))


MASTER = Dial("B", "A", "10.0.0.1", 29501, "the head's master port")


def test_a_dial_fails_only_while_its_target_listened_and_names_host_address_and_port():
    listening = lines("listen 10.0.0.1 29501 ok - 100.0 113.0")
    r = check_ports(host("B"), [MASTER], lines("dial 10.0.0.1 29501 timeout 8 100.5 108.5"), {"A": listening}, {})
    assert r.status == FAIL and r.detail.startswith("B cannot reach 10.0.0.1:29501 on A (the head's master port): ")
    assert "SYN was dropped" in r.detail and "allow TCP 29501 from B on A" in r.hint
    # the listener came up only after B had given up: nothing shown either way
    late = lines("listen 10.0.0.1 29501 ok - 109.0 122.0")
    r = check_ports(host("B"), [MASTER], lines("dial 10.0.0.1 29501 refused 30 100.5 108.5"), {"A": late}, {})
    assert r.status == WARN and "not up while it tried" in r.detail
    # ... unless A's clock runs 10 s ahead of B's: then it was up all along
    r = check_ports(host("B"), [MASTER], lines("dial 10.0.0.1 29501 refused 30 100.5 108.5"), {"A": late},
                      {"A": 10.0, "B": 0.0})
    assert r.status == FAIL and "refused while A listened" in r.detail
    ok = check_ports(host("B"), [MASTER], lines("dial 10.0.0.1 29501 connected 1 100.5 100.6"), {"A": listening}, {})
    assert ok.status == PASS and "A 10.0.0.1:29501" in ok.detail


def test_a_probe_that_could_not_run_is_no_verdict():
    r = check_ports(host("B"), [MASTER], Output(127, "@@missing python3\n", "python3"), {"A": None}, {})
    assert r.status == WARN and "python3" in r.detail and "not tried" in r.detail
    r = check_ports(host("B"), [MASTER], lines("dial 10.0.0.1 29501 timeout 8 100.5 108.5"), {"A": None}, {})
    assert r.status == WARN and "held no listener" in r.detail
