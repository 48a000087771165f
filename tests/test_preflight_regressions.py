"""Parsers and checks of preflight's host regressions (railyard.facts.regressions, railyard.checks.regressions),
the parsers on real captures (tests/fixtures/real/ORIGINS.md: meminfo/, getent/, nccl-conf/)."""

from __future__ import annotations

import pytest

from railyard.checks import FAIL, PASS, SKIP, WARN
from railyard.checks.regressions import check_cma, check_gloo_iface, check_nccl_conf, check_nccl_lib, nccl_lib_of
from railyard.facts import ParseError
from railyard.facts.probe import Output, joined_script, new_token
from railyard.facts.regressions import (NCCL_LIB_SCRIPT, image_files_section, parse_hostname, parse_meminfo,
                                        parse_nccl_conf, parse_nccl_lib)
from railyard.inventory import load_inventory

from .conftest import real


def rank_env(host, layout: str) -> dict[str, str]:
    """What the layout renders for the host's ranks (its hook: railyard.plan.layout.Layout.rank_env)."""
    import railyard.layouts  # noqa: F401  (the layouts register themselves)
    from railyard.plan import layout as layouts
    return layouts.by_name(layout).rank_env(None, host)  # type: ignore[arg-type]


def spans(layout: str) -> bool:
    import railyard.layouts  # noqa: F401
    from railyard.plan import layout as layouts
    return layouts.by_name(layout).ranks_span_hosts

INV = """
all:
  vars:
    cluster_serve_rail: cx8r1
    cluster_gpu_name: {gpu}
    vllm_image: "vllm/vllm-openai:v0.30.0@sha256:{digest}"
    model_repo: x/y
    model_path: /models/y
    model_revision: "0123456789abcdef0123456789abcdef01234567"
    model_size_gb: 1
    vllm_tensor_parallel_size: 2
  children:
    lab:
      hosts:
        A: {{ansible_host: 10.0.0.1, rank: 0, rails: {{cx8r1: {{hca: mlx5_1, ipv4: 198.18.101.11/24}}}}}}
        B: {{ansible_host: 10.0.0.2, rank: 1, rails: {{cx8r1: {{hca: mlx5_1, ipv4: 198.18.101.12/24}}}}}}
"""


def inv(gpu="GB300"):
    import tempfile
    from pathlib import Path
    path = Path(tempfile.mkdtemp()) / "inventory.yml"
    path.write_text(INV.format(gpu=gpu, digest="a" * 64))
    return load_inventory(path)


# ---------------------------------------------------------------- cma

def test_meminfo_parses_real_captures():
    m = parse_meminfo(real("meminfo/vm-6.18-x86_64_no-cma.txt"))
    assert m["MemTotal"] > 0 and "CmaTotal" not in m and "HugePages_Total" in m
    assert parse_meminfo(real("meminfo/switchtec-13_grep-cma_cma32G.txt")) == {"CmaTotal": 33554432,
                                                                                "CmaFree": 33501788}
    assert parse_meminfo(real("meminfo/dgx-spark-kho_miaai-259.txt")) == {"CmaTotal": 0, "CmaFree": 940604}
    with pytest.raises(ParseError):
        parse_meminfo("cat: /proc/meminfo: No such file or directory\n")


def test_cma_fails_the_kho_signature_on_a_grace_gpu_only():
    i = inv("GB10")
    spark = check_cma(i.host("B"), Output(0, real("meminfo/dgx-spark-kho_miaai-259.txt")))
    assert spark.status == FAIL and "CmaFree 918 MiB exceeds CmaTotal 0 MiB" in spark.detail
    assert "kho=off" in spark.hint and "CmaTotal: 0 kB, CmaFree: 940604 kB" in spark.evidence
    # an accounted CMA area (cma=32G), and kho=off's 0/0: pass
    assert check_cma(i.host("B"), Output(0, real("meminfo/switchtec-13_grep-cma_cma32G.txt"))).status == PASS
    assert check_cma(i.host("B"), Output(0, "CmaTotal:        0 kB\nCmaFree:         0 kB\n")).status == PASS
    assert check_cma(i.host("B"), Output(0, real("meminfo/vm-6.18-x86_64_no-cma.txt"))).status == PASS
    # a discrete GPU registers its own memory: nothing to judge
    assert check_cma(inv("H200").host("B"), Output(0, real("meminfo/dgx-spark-kho_miaai-259.txt"))).status == SKIP
    assert check_cma(i.host("B"), Output(None, "")).status == FAIL


# ---------------------------------------------------------------- nccl.conf

def test_nccl_conf_parses_as_nccl_reads_it():
    lines = parse_nccl_conf(real("nccl-conf/nccl-docs-env-example.conf"))
    assert [(c.number, c.key, c.value) for c in lines] == [(1, "NCCL_DEBUG", "WARN"),
                                                           (2, "NCCL_SOCKET_IFNAME", "=ens1f0")]
    assert [c.key for c in parse_nccl_conf(real("nccl-conf/azhpc-ndv2.conf"))] == ["NCCL_TOPO_FILE"]
    assert parse_nccl_conf("# NCCL_IB_DISABLE=1\nnot a setting\n\nNCCL_P2P_DISABLE=1\n")[0].number == 4


def _image(conf: str | None, lib: str = "path /x/libnccl.so.2\nsha256 " + "b" * 64 + "\nversion NCCL version 2.30.7+cuda13.0",
           lib_rc: int = 0) -> Output:
    part = "@@part nccl_conf rc=1\n" if conf is None else f"@@part nccl_conf rc=0\n{conf}\n"
    return Output(0, part + f"@@part nccl_lib rc={lib_rc}\n{lib}\n")


def test_nccl_conf_fails_lines_in_effect_and_warns_shadowed_ones():
    i = inv()
    b = i.host("B")
    assert check_nccl_conf(b, _image(None), True, rank_env(b, "multinode_tp")).status == PASS
    # both keys are rendered by railyard for multinode_tp: NCCL keeps the environment's values
    shadowed = check_nccl_conf(b, _image(real("nccl-conf/nccl-docs-env-example.conf")), True, rank_env(b, "multinode_tp"))
    assert shadowed.status == WARN and "NCCL_SOCKET_IFNAME==ens1f0 (line 2)" in shadowed.detail
    live = check_nccl_conf(b, _image(real("nccl-conf/azhpc-ndv2.conf")), True, rank_env(b, "multinode_tp"))
    assert live.status == FAIL and "NCCL_TOPO_FILE=/opt/microsoft/ndv2/topo.xml (line 1)" in live.detail
    # a single-node layout renders no NCCL env: every line is in effect
    assert check_nccl_conf(b, _image(real("nccl-conf/nccl-docs-env-example.conf")), True,
                           rank_env(b, "single_node_tp")).status == FAIL
    assert check_nccl_conf(b, _image(None), False, rank_env(b, "multinode_tp")).status == SKIP
    ran_not = check_nccl_conf(b, Output(125, "docker: Error response from daemon: No such image: x.\n"), True,
                              rank_env(b, "multinode_tp"))
    assert ran_not.status == FAIL and "No such image" in ran_not.evidence


# ---------------------------------------------------------------- nccl lib

def test_nccl_lib_script_reads_version_and_digest(tmp_path):
    import hashlib
    import subprocess
    import sys
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "nvidia" / "nccl" / "__init__.py").write_text("")
    blob = b"\x7fELF" + b"x" * (5 << 20) + b"NCCL version 2.27.3+cuda12.9\x00tail"
    (lib / "libnccl.so.2").write_bytes(blob)
    out = subprocess.run([sys.executable, "-c", NCCL_LIB_SCRIPT], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path)}).stdout
    got = parse_nccl_lib(out)
    assert got.version == "NCCL version 2.27.3+cuda12.9"
    assert got.sha256 == hashlib.sha256(blob).hexdigest() and got.path.endswith("nccl/lib/libnccl.so.2")
    with pytest.raises(ParseError):
        parse_nccl_lib("no nvidia.nccl module: No module named 'nvidia'\n")


def test_nccl_lib_names_both_builds():
    i = inv()
    a, b = i.host("A"), i.host("B")
    la, _ = nccl_lib_of(a, _image(None), True)
    lb, _ = nccl_lib_of(b, _image(None, "path /x/libnccl.so.2\nsha256 " + "c" * 64 + "\nversion NCCL version 2.27.3+cuda12.9"),
                        True)
    assert la and lb
    same = check_nccl_lib([a, b], {"A": la, "B": la})
    assert same["A"].status == PASS and "2.30.7+cuda13.0 (sha256:bbbbbbbbbbbb), the same on 2" in same["A"].detail
    res = check_nccl_lib([a, b], {"A": la, "B": lb})
    assert res["B"].status == FAIL and "2.27.3+cuda12.9 (sha256:cccccccccccc)" in res["B"].detail
    assert "A load(s) 2.30.7+cuda13.0" in res["B"].detail
    assert res["A"].status == FAIL and "B (2.27.3+cuda12.9" in res["A"].detail
    missing, bad = nccl_lib_of(b, _image(None, "no nvidia.nccl module: No module named 'nvidia'", 3), True)
    assert missing is None and bad is not None and bad.status == FAIL and "nvidia" in bad.evidence


def test_image_section_quotes_the_image_and_stays_one_command():
    s = image_files_section("x/y:1@sha256:" + "a" * 64 + "; rm -rf /")
    assert "'x/y:1@sha256:" in s.command and "--pull never" in s.command and "--network none" in s.command
    joined_script([s], new_token())  # joins with the others


# ---------------------------------------------------------------- gloo

def _ip(addr="198.18.101.12/24"):
    return Output(0, f"lo               UNKNOWN        127.0.0.1/8 ::1/128\ncx8r1@if5       UP             {addr}\n")


def test_hostname_parses_real_getent():
    r = parse_hostname("@@name vm\n" + real("getent/vm_hostname-on-loopback.txt"))
    assert r.name == "vm" and r.addresses == ["127.0.0.1"]
    assert parse_hostname("@@name A\n" + real("getent/lab-A_mgmt.txt")).addresses == ["198.18.50.11"]
    assert parse_hostname("@@name nowhere\n").addresses == []


def test_gloo_iface_rendered_variable_wins_and_loopback_fails_across_hosts():
    i = inv()
    b = i.host("B")
    assert rank_env(b, "multinode_tp")["GLOO_SOCKET_IFNAME"] == "cx8r1"
    loop = Output(0, "@@name B\n127.0.1.1       B\n")
    ok = check_gloo_iface(b, rank_env(b, "multinode_tp"), spans("multinode_tp"), loop, _ip())
    assert ok.status == PASS and "cx8r1 (198.18.101.12)" in ok.detail and "127.0.1.1" in ok.evidence
    no_addr = check_gloo_iface(b, rank_env(b, "multinode_tp"), spans("multinode_tp"), loop, Output(0, "cx8r1@if5 UP\n"))
    assert no_addr.status == FAIL and "cx8r1 has no IPv4 address" in no_addr.detail
    # the variable cleared (vllm_extra_env): the host's own name decides
    b.vars["vllm_extra_env"] = {"GLOO_SOCKET_IFNAME": ""}
    bad = check_gloo_iface(b, rank_env(b, "multinode_tp"), spans("multinode_tp"), loop, _ip())
    assert bad.status == FAIL and "B resolves to 127.0.1.1" in bad.detail
    unresolved = check_gloo_iface(b, rank_env(b, "multinode_tp"), spans("multinode_tp"), Output(2, "@@name B\n"), _ip())
    assert unresolved.status == FAIL and "does not resolve" in unresolved.detail
    good = check_gloo_iface(b, rank_env(b, "multinode_tp"), spans("multinode_tp"), Output(0, "@@name B\n" + "10.0.0.2        B\n"), _ip())
    assert good.status == PASS and "Gloo binds 10.0.0.2" in good.detail
    # one host's ranks: loopback serves them
    assert check_gloo_iface(b, rank_env(b, "single_node_tp"), spans("single_node_tp"), loop, _ip()).status == PASS
