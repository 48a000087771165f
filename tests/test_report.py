"""The --json contract of every task, from unit data (no lab): {"ok", "checks", "data"}, ok false
exactly when a check failed, exit 1 then; usage errors exit 2 with nothing on stdout."""

from __future__ import annotations

import json

import pytest
from invoke.exceptions import Exit

from railyard import cli
from railyard.cli import health as health_cli, nccl, serve, verify as verify_cli
from railyard import report as R
from railyard.verbs.capacity import LayoutPlan, Plan, plan_json, plan_report
from railyard.checks import CheckResult
from railyard.errors import LaunchError, UsageError
from railyard.checks.nccl import RankVerdict
from railyard.verbs.nccl_check import CheckReport, SizeResult, nccl_report
from railyard.verbs.preflight import preflight_report
from railyard.verbs.serve import status_report
from railyard.verbs.sync import CopyPlan, Difference, FileInfo, Manifest, SyncReport, TargetResult, sync_report
from railyard.verbs.health import health_report
from railyard.verbs.verify import rdma_report
from railyard.checks.probes import Probe, RankHealth

CHECK_KEYS = {"host", "check", "status", "detail", "evidence", "hint"}


def shape(rep: R.Report) -> dict:
    """The document as a machine reads it, with the contract asserted."""
    doc = json.loads(rep.json())
    assert list(doc)[:3] == ["ok", "checks", "data"] and isinstance(doc["data"], dict)
    assert doc["checks"], "a report always judges something"
    for c in doc["checks"]:
        assert set(c) == CHECK_KEYS and c["status"] in ("pass", "warn", "fail", "skip")
        assert all(isinstance(c[k], str) for k in CHECK_KEYS)
    failed = any(c["status"] == "fail" for c in doc["checks"])
    assert doc["ok"] is (not failed) and rep.exit_code == (1 if failed else 0)
    return doc


def statuses(doc: dict) -> dict:
    return {(c["host"], c["check"]): c["status"] for c in doc["checks"]}


# ---------------------------------------------------------------- the document itself

def test_report_json_refuses_an_ok_that_contradicts_the_checks():
    fail = [CheckResult("A", "mtu", "fail", "mtu 1500")]
    with pytest.raises(ValueError):
        R.report_json(True, fail, {})
    with pytest.raises(ValueError):
        R.report_json(False, [CheckResult("A", "mtu", "pass", "mtu 9000")], {})
    with pytest.raises(ValueError):
        R.report_json(True, [CheckResult("A", "mtu", "ok", "?")], {})
    doc = json.loads(R.report_json(False, fail, {"x": 1}))
    assert doc == {"ok": False, "checks": [{"host": "A", "check": "mtu", "status": "fail", "detail": "mtu 1500",
                                            "evidence": "", "hint": ""}], "data": {"x": 1}}


def test_a_failed_check_gives_exit_1_and_ok_false_warn_and_skip_do_not():
    ok = R.Report([CheckResult("A", "ntp", "warn", "inactive"), CheckResult("B", "route", "skip", "no peers")])
    assert ok.ok and ok.exit_code == 0 and R.exit_code(ok.checks) == 0
    bad = R.Report(ok.checks + [CheckResult("B", "gid", "fail", "no RoCE v2 GID")])
    assert not bad.ok and bad.exit_code == 1 and json.loads(bad.json())["ok"] is False


# ---------------------------------------------------------------- per task

def test_preflight():
    results = [CheckResult("A", "mtu", "pass", "cx8r1 mtu 9000", "4: cx8r1: mtu 9000"),
               CheckResult("B", "mtu", "fail", "cx8r1 mtu 1500, expected 9000", "", "ip link set dev cx8r1 mtu 9000")]
    doc = shape(preflight_report(results))
    assert doc["ok"] is False and doc["data"] == {} and [c["host"] for c in doc["checks"]] == ["A", "B"]


def status_row(host, rank, running=True, current=True, pinned=True, **kw):
    row = {"host": host, "rank": rank, "service": f"rank{rank}", "role": "head" if rank == 0 else "worker",
           "container": "glm53-full", "state": "running" if running else "exited", "running": running,
           "started_at": "2026-01-01T00:00:00Z", "uptime_s": 12.0 if running else None, "image_id": "sha256:" + "a" * 64,
           "image_digests": [], "pinned_digest_ok": pinned, "config": "c" * 64, "config_current": current,
           "gpu_uuid": "GPU-1", "gpu_uuids": ["GPU-1"], "gpu_memory": {"used_mib": 250000, "total_mib": 284208}}
    row.update(kw)
    return row


def test_status_one_container_check_per_service():
    rows = [status_row("A", 0), status_row("B", 1)]
    doc = shape(status_report(rows))
    assert doc["ok"] and statuses(doc) == {("A", "container"): "pass", ("B", "container"): "pass"}
    assert doc["data"]["ranks"] == rows  # nothing lost
    rows = [status_row("A", 0, current=False), status_row("B", 1, running=False),
            {"host": "C", "rank": 2, "service": "rank2", "state": "unreachable", "running": False, "error": "timeout"}]
    doc = shape(status_report(rows))
    assert not doc["ok"] and set(statuses(doc).values()) == {"fail"}
    assert "another configuration" in doc["checks"][0]["detail"] and doc["checks"][0]["hint"] == "inv launch --recreate"
    assert "exited" in doc["checks"][1]["detail"] and "timeout" in doc["checks"][2]["detail"]
    doc = shape(status_report([status_row("A", 0, pinned=False)]))
    assert doc["ok"] and doc["checks"][0]["status"] == "warn" and "NOT the pinned digest" in doc["checks"][0]["detail"]


def health_data(dead: str | None = None):
    ranks = [RankHealth(h, r, f"rank{r}", "exited" if h == dead else "running", None if h == dead else 30.0,
                        None if h == dead else 250000, None if h == dead else f"VLLM::Worker_TP{r}", h != dead,
                        ["container glm53-full is exited"] if h == dead else [])
             for h, r in (("A", 0), ("B", 1))]
    probes = [Probe("/health", dead is None, "HTTP 200" if dead is None else "no answer", 3.0),
              Probe("/v1/models", True, "HTTP 200; serves glm", 5.0),
              Probe("chat completion", True, "HTTP 200; finish_reason stop; 8 tokens", 120.0),
              Probe("/metrics", True, "HTTP 200", 4.0)]
    return ranks, probes, {"running": 0.0, "waiting": 0.0, "spec_acceptance": 0.75}


def test_health_one_check_per_service_and_per_probe():
    ranks, probes, metrics = health_data()
    doc = shape(health_report(ranks, probes, metrics, "A"))
    assert doc["ok"] and statuses(doc) == {("A", "service"): "pass", ("B", "service"): "pass",
                                           ("A", "api_health"): "pass", ("A", "api_models"): "pass",
                                           ("A", "api_chat"): "pass", ("A", "api_metrics"): "pass"}
    assert [p["name"] for p in doc["data"]["probes"]] == ["/health", "/v1/models", "chat completion", "/metrics"]
    assert doc["data"]["ranks"][1]["serving_process"] == "VLLM::Worker_TP1"
    assert doc["data"]["metrics"]["spec_acceptance"] == 0.75
    assert "120 ms" in next(c for c in doc["checks"] if c["check"] == "api_chat")["evidence"]
    ranks, probes, metrics = health_data(dead="B")
    doc = shape(health_report(ranks, probes, metrics, "A"))
    assert not doc["ok"] and statuses(doc)[("B", "service")] == "fail" and statuses(doc)[("A", "api_health")] == "fail"
    b = next(c for c in doc["checks"] if c["host"] == "B")
    assert "container glm53-full is exited" in b["detail"] and "inv logs --rank B" in b["hint"]


def gdr(host: str, where: str = "/tmp/nccl_{}_1.log") -> RankVerdict:
    return RankVerdict(f"{host}:{where.format(host)}", "pass", "IB", True, ["mlx5_1"], "2.30.7", [])


def socket(host: str, where: str = "/tmp/nccl_{}_1.log") -> RankVerdict:
    return RankVerdict(f"{host}:{where.format(host)}", "fail", "Socket", False, [], "2.30.7", [],
                       ["2 inter-node channel(s) over Socket, not IB (fix: pass --device /dev/infiniband)",
                        "IPC_LOCK not granted (fix: docker run --cap-add IPC_LOCK)"])


def test_verify_rdma_one_check_per_rank_verdict():
    doc = shape(rdma_report([gdr("A"), gdr("B")]))
    assert doc["ok"] and statuses(doc) == {("A", "rdma"): "pass", ("B", "rdma"): "pass"}
    assert doc["data"]["ranks"][0]["source"] == "A:/tmp/nccl_A_1.log" and doc["data"]["ranks"][0]["hcas"] == ["mlx5_1"]
    doc = shape(rdma_report([gdr("A"), socket("B")]))
    b = doc["checks"][1]
    assert not doc["ok"] and b["status"] == "fail" and b["host"] == "B"
    assert b["detail"] == "2 inter-node channel(s) over Socket, not IB; IPC_LOCK not granted"
    assert b["hint"] == "pass --device /dev/infiniband; docker run --cap-add IPC_LOCK"
    assert "transport Socket, GDRDMA no" in b["evidence"]


def test_verify_rdma_a_one_host_layout_is_a_skip_never_a_pass_and_nothing_judged_fails():
    doc = shape(rdma_report([], skipped="SKIP: layout single_node_tp runs on one host", skip_host="A",
                              layout="single_node_tp"))
    assert doc["ok"] and [c["status"] for c in doc["checks"]] == ["skip"]
    assert doc["data"] == {"ranks": [], "skipped": "SKIP: layout single_node_tp runs on one host",
                           "layout": "single_node_tp"}
    doc = shape(rdma_report([]))
    assert not doc["ok"] and doc["checks"][0]["status"] == "fail"


PROBE = "railyard-nccl-check"


def nccl_rep(fraction=0.82, errors=(), b_verdict=None) -> CheckReport:
    sizes = [SizeResult(1 << 20, 0.2, 5.0, 5.0), SizeResult(1 << 30, 26.0, 41.0, 41.0)] if fraction else []
    ranks = [gdr("A", PROBE), b_verdict or gdr("B", PROBE)]
    ok = not errors and bool(sizes) and all(v.verdict == "pass" for v in ranks) and fraction is not None and fraction >= 0.7
    return CheckReport(ok, ranks, sizes, fraction, 0.7, 400000, list(errors), ["A", "B"])


def test_nccl_check_probe_rdma_per_rank_and_one_bandwidth_check():
    rep = nccl_rep()
    doc = shape(nccl_report(rep))
    assert doc["ok"] is rep.ok is True
    assert statuses(doc) == {("A", "probe"): "pass", ("B", "probe"): "pass", ("A", "rdma"): "pass",
                             ("B", "rdma"): "pass", ("-", "bandwidth"): "pass"}
    d = doc["data"]
    assert [s["bytes"] for s in d["sizes"]] == [1 << 20, 1 << 30] and d["link_fraction"] == 0.82
    assert d["threshold"] == 0.7 and d["link_speed_mbps"] == 400000 and d["removed"] == ["A", "B"] and "ok" not in d
    assert len(d["ranks"]) == 2 and d["errors"] == []


@pytest.mark.parametrize("rep,failing", [
    (nccl_rep(fraction=0.3), {("-", "bandwidth")}),
    (nccl_rep(b_verdict=socket("B", PROBE)), {("B", "rdma")}),
    (nccl_rep(fraction=None, errors=["B: the probe did not finish within 3 s"]),
     {("B", "probe"), ("A", "probe"), ("-", "bandwidth")}),
    (nccl_rep(errors=["somewhere: odd"]), {("-", "probe")}),
])
def test_nccl_check_failures_agree_with_the_report(rep, failing):
    doc = shape(nccl_report(rep))
    assert doc["ok"] is rep.ok is False
    assert {k for k, v in statuses(doc).items() if v == "fail"} == failing


def manifest(host, files=2, error=None) -> Manifest:
    fs = {f"model-{i:05d}.safetensors": FileInfo(1000, 1, "ab" * 32) for i in range(files)}
    fs["config.json"] = FileInfo(10, 1, "cd" * 32)
    return Manifest(host, error is None, {} if error else fs, {"architectures": ["GlmMoeDsaForCausalLM"]}, {},
                    error=error)


def sync_rep(**kw) -> SyncReport:
    rep = SyncReport("A", "content", ["B", "C"],
                     manifests={h: manifest(h) for h in "ABC"},
                     copies={h: TargetResult(h, CopyPlan(h, send=["x"], bytes=1000), 1000, 1.5) for h in "BC"},
                     differences={"B": [], "C": []}, model={h: [] for h in "ABC"})
    for k, v in kw.items():
        setattr(rep, k, v)
    return rep


def test_sync_model_model_per_host_and_sync_per_target():
    rep = sync_rep()
    doc = shape(sync_report(rep))
    assert doc["ok"] is rep.ok is True
    assert statuses(doc) == {("A", "model"): "pass", ("B", "model"): "pass", ("C", "model"): "pass",
                             ("B", "sync"): "pass", ("C", "sync"): "pass"}
    assert "sha256 of every file" in doc["checks"][3]["detail"]
    d = doc["data"]
    assert d["source"] == "A" and d["verify"] == "content" and "ok" not in d
    assert [h["host"] for h in d["hosts"]] == ["A", "B", "C"] and d["hosts"][1]["copy"]["bytes_sent"] == 1000
    size = shape(sync_report(sync_rep(verify="size")))
    assert "content not compared" in size["checks"][3]["detail"]


def test_sync_model_failures_agree_with_the_report():
    rep = sync_rep(differences={"B": [Difference("model-00000.safetensors", "content", "ab", "ff")], "C": []},
                   model={"A": [], "B": [], "C": ["config.json missing"]})
    doc = shape(sync_report(rep))
    assert doc["ok"] is rep.ok is False
    assert {k for k, v in statuses(doc).items() if v == "fail"} == {("B", "sync"), ("C", "model")}
    b = next(c for c in doc["checks"] if c["check"] == "sync" and c["host"] == "B")
    assert "content differs: model-00000.safetensors" in b["detail"] and "--repair" in b["hint"]
    rep = sync_rep()
    rep.copies["C"].errors.append("rsync exit 12")
    rep.manifests["B"] = manifest("B", error="timeout: no answer")
    rep.model["B"] = ["timeout: no answer"]
    doc = shape(sync_report(rep))
    assert doc["ok"] is rep.ok is False
    assert {k for k, v in statuses(doc).items() if v == "fail"} == {("B", "model"), ("B", "sync"), ("C", "sync")}
    stopped = sync_rep(failure="A cannot ssh non-interactively to B", hint="ssh-copy-id", copies={}, manifests={})
    doc = shape(sync_report(stopped))
    assert not doc["ok"] and doc["checks"] == [{"host": "A", "check": "sync", "status": "fail", "hint": "ssh-copy-id",
                                                "detail": "A cannot ssh non-interactively to B", "evidence": ""}]


def test_sync_model_dry_run_skips_every_target():
    rep = sync_rep(dry_run=True, manifests={}, differences={}, model={},
                   copies={"B": TargetResult("B", CopyPlan("B", send=["x", "y"], equal=3, bytes=2000))})
    doc = shape(sync_report(rep))
    assert doc["ok"] and statuses(doc) == {("B", "sync"): "skip", ("C", "sync"): "skip"}
    assert "would send 2 file(s)" in doc["checks"][0]["detail"] and "would download" in doc["checks"][1]["detail"]


def plan_doc(fits_dp=True) -> dict:
    layouts = [LayoutPlan("single_node_tp", 8, 1, 1, 1, 60.1, 5000, 60.0, 400000, 400000, 12, True, 1.0),
               LayoutPlan("dp_ep", 1, 8, 8, 8, 90.0, 40000, 20.0 if fits_dp else 0.0, 30000 if fits_dp else 0,
                          240000 if fits_dp else 0, 7 if fits_dp else 0, fits_dp, 0.6,
                          [] if fits_dp else ["weights leave no KV cache: vLLM would not start"])]
    return plan_json(Plan("GlmMoeDsaForCausalLM", None, None, {"gpus": 8, "gpu_memory_utilization": 0.9}, layouts))


def test_plan_keeps_its_top_level_contract_and_adds_checks_and_data():
    doc = shape(plan_report(plan_doc()))
    assert doc["ok"] and statuses(doc) == {("-", "fits_single_node_tp"): "pass", ("-", "fits_dp_ep"): "pass"}
    assert set(doc) == {"ok", "checks", "data", "model", "assumptions", "layouts"}
    assert doc["data"] == {"model": doc["model"], "assumptions": doc["assumptions"], "layouts": doc["layouts"]}
    assert [lp["layout"] for lp in doc["layouts"]] == ["single_node_tp", "dp_ep"]
    doc = shape(plan_report(plan_doc(fits_dp=False)))  # a layout that does not fit is a finding, not a failure
    assert doc["ok"] and statuses(doc)[("-", "fits_dp_ep")] == "warn" and "no KV cache" in doc["checks"][1]["detail"]


# ---------------------------------------------------------------- through the tasks: stdout, exit code

def run_task(capsys, fn, *args, **kw):
    code = 0
    try:
        fn(*args, **kw)
    except Exit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_inventory(monkeypatch):
    monkeypatch.setattr(cli, "load_inventory", lambda *a: None)


def test_status_task_a_failed_check_exits_1_with_one_document(capsys, monkeypatch, no_inventory):
    from railyard.verbs import serve as launch
    monkeypatch.setattr(launch, "status", lambda inv: ([status_row("A", 0), status_row("B", 1, running=False)],
                                                       {"error": "the recovery record was not read: A: unreachable"}))
    code, out, err = run_task(capsys, serve.status, None, True)
    doc = json.loads(out)  # exactly one document
    assert code == 1 and doc["ok"] is False and doc["data"]["ranks"][1]["state"] == "exited" and err == ""
    code, out, _ = run_task(capsys, serve.status, None, False)
    assert code == 1 and "FAILED: B: rank1: container glm53-full is exited" in out


def test_health_and_verify_tasks(capsys, monkeypatch, no_inventory):
    from railyard.verbs import health, verify
    plan = type("P", (), {"endpoint": type("E", (), {"host": "A", "service": "rank0"})(), "layout": "multinode_tp",
                          "verifiers": ("rdma",), "hosts": lambda self: ["A", "B"]})()
    monkeypatch.setattr(health, "health", lambda inv, proof=0, canary="": (plan, *health_data(dead="B")))
    code, out, _ = run_task(capsys, health_cli.health, None, True)
    assert code == 1 and json.loads(out)["ok"] is False
    monkeypatch.setattr(verify, "verify_rdma", lambda inv: (plan, [gdr("A"), gdr("B")]))
    code, out, _ = run_task(capsys, verify_cli.verify_rdma, None, None, True)
    assert code == 0 and statuses(json.loads(out)) == {("A", "rdma"): "pass", ("B", "rdma"): "pass"}
    monkeypatch.setattr(verify, "verify_rdma", lambda inv: (plan, []))
    code, out, _ = run_task(capsys, verify_cli.verify_rdma, None, None, True)
    assert code == 0 and [c["status"] for c in json.loads(out)["checks"]] == ["skip"]


def test_nccl_check_task(capsys, monkeypatch, no_inventory):
    from railyard.verbs import nccl_check as ncclcheck
    monkeypatch.setattr(ncclcheck, "nccl_check", lambda *a: nccl_rep(fraction=0.3))
    code, out, _ = run_task(capsys, nccl.nccl_check, None, None, None, True)
    doc = json.loads(out)
    assert code == 1 and not doc["ok"] and doc["data"]["link_fraction"] == 0.3


def test_an_error_before_any_check_is_one_document_exit_1_a_usage_error_prints_nothing(capsys, monkeypatch,
                                                                                       no_inventory):
    from railyard.verbs import serve as launch

    def unreachable(inv):
        raise LaunchError("B: unreachable: no route to host")
    monkeypatch.setattr(launch, "status", unreachable)
    code, out, err = run_task(capsys, serve.status, None, True)
    doc = json.loads(out)
    assert code == 1 and err == "error: B: unreachable: no route to host\n"
    assert doc["ok"] is False and doc["checks"] == [{"host": "-", "check": "status", "status": "fail",
                                                     "detail": "B: unreachable: no route to host", "evidence": "",
                                                     "hint": ""}]
    code, out, _ = run_task(capsys, serve.status, None, False)  # without --json: the line only
    assert code == 1 and out == ""

    def usage(inv):
        raise UsageError("--rank Z: no such host")
    monkeypatch.setattr(launch, "status", usage)
    code, out, err = run_task(capsys, serve.status, None, True)
    assert code == 2 and out == "" and err.count("\n") == 1
