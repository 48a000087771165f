"""inv bench without the lab: AIPerf's real exports parsed (tests/fixtures/real/aiperf, see its
ORIGINS.md), the SLO language, the AIPerf command, the plots and the table, and usage errors."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from railyard.bench import aiperf
from railyard.cli import bench as view
from railyard.bench.aiperf import Load, parse_export, record_errors
from railyard.bench.plots import plot_all
from railyard.bench.run import Options, Series, make_summary, parse_concurrency
from railyard.bench.slo import best_concurrency, parse_slo, parse_slos, verdicts
from railyard.errors import UsageError

from .conftest import REAL, inv_cmd

AIPERF = REAL / "aiperf"


def export(name):
    return json.loads((AIPERF / name).read_text())


def test_the_lab_export_reads_as_the_guide_s_table_row_in_railyard_s_units():
    p = parse_export(export("local-lab-c4.profile_export_aiperf.json"))
    assert p.concurrency == 4 and p.requests == 12 and p.errors == 0 and p.aiperf_version == "0.13.0"
    assert p.units["time_to_first_token"] == "ms" and p.units["output_token_throughput_per_user"] == "tokens/sec/user"
    assert p.metrics["output_tok_s"] == pytest.approx(824.0, abs=0.1)
    assert p.metrics["per_user_tok_s"] == pytest.approx(317.101, abs=1e-3)
    doc = export("local-lab-c4.profile_export_aiperf.json")
    assert p.metrics["ttft_mean_s"] == pytest.approx(doc["time_to_first_token"]["avg"] / 1000)   # ms -> s
    assert p.metrics["ttft_p90_s"] == pytest.approx(doc["time_to_first_token"]["p90"] / 1000)
    assert p.metrics["itl_mean_ms"] == pytest.approx(doc["inter_token_latency"]["avg"])
    assert p.metrics["latency_mean_s"] == pytest.approx(doc["request_latency"]["avg"] / 1000)
    assert p.duration_s == pytest.approx(doc["benchmark_duration"]["avg"])
    assert aiperf.value(p, "tpot_mean_ms") == p.metrics["itl_mean_ms"]


def test_the_concurrency_is_the_measured_phase_s_not_the_warm_up_s():
    doc = export("local-lab-c1.profile_export_aiperf.json")
    assert [ph["kind"] for ph in doc["input_config"]["phases"]] == ["warmup", "profiling"]
    assert parse_export(doc).concurrency == 1


def test_failed_requests_are_counted_and_a_missing_error_count_is_zero():
    p = parse_export(export("local-stub-partial-500.profile_export_aiperf.json"))
    assert (p.requests, p.errors) == (2, 2)
    assert p.error_summary[0]["error_details"]["code"] == 500
    assert "error_request_count" not in export("local-lab-c4.profile_export_aiperf.json")


def test_every_request_failing_names_the_http_error_from_the_records():
    errs = record_errors((AIPERF / "local-stub-all-401.profile_export.jsonl").read_text())
    assert errs == {'HTTP 401 Unauthorized: {"error":"Unauthorized"}': 4}  # the 4 measured, not the 2 warm-up


def test_units_are_read_not_assumed():
    doc = export("local-lab-c4.profile_export_aiperf.json")
    doc["time_to_first_token"] = dict(doc["time_to_first_token"], unit="s", avg=0.5)
    assert parse_export(doc).metrics["ttft_mean_s"] == 0.5
    doc["time_to_first_token"]["unit"] = "furlongs"
    with pytest.raises(ValueError, match="furlongs"):
        parse_export(doc)
    with pytest.raises(ValueError, match="not an AIPerf"):
        parse_export({"hello": 1})


def test_slos_parse_judge_and_name_their_mistakes():
    assert str(parse_slo("per_user_tok_s>=30")) == "per_user_tok_s>=30"
    assert [str(s) for s in parse_slos(["ttft_mean_s<=2.5,tpot_mean_ms<=20"])] == ["ttft_mean_s<=2.5", "tpot_mean_ms<=20"]
    with pytest.raises(UsageError, match=r"--slo 'ttft_mean_s=2': expected METRIC<=VALUE"):
        parse_slo("ttft_mean_s=2")
    with pytest.raises(UsageError, match="unknown metric 'ttft_men_s' \\(did you mean ttft_mean_s\\?\\)"):
        parse_slo("ttft_men_s<=2")
    c1 = parse_export(export("local-lab-c1.profile_export_aiperf.json"))
    c4 = parse_export(export("local-lab-c4.profile_export_aiperf.json"))
    slos = parse_slos(["per_user_tok_s>=400"])   # C=1 serves ~487 tok/s per user, C=4 ~317
    assert [(v.concurrency, v.ok) for v in verdicts([c1, c4], slos)] == [(1, True), (4, False)]
    assert best_concurrency([c1, c4], slos) == 1
    assert best_concurrency([c1, c4], parse_slos(["per_user_tok_s>=1000"])) is None
    bad = parse_export(export("local-stub-partial-500.profile_export_aiperf.json"))
    assert not any(v.ok for v in verdicts([bad], parse_slos(["request_s>=0"])))  # failed requests fail every SLO


def test_the_aiperf_command_streams_excludes_warm_up_fixes_the_seed_and_carries_no_key(tmp_path):
    argv = aiperf.profile_argv("m", "http://127.0.0.1:1", "/tok", 8, Load(isl=64, osl=16), tmp_path / "c8", None)
    joined = " ".join(argv)
    assert "--streaming" in argv and "--api-key" not in joined
    assert argv[argv.index("--concurrency") + 1] == "8"
    assert argv[argv.index("--request-count") + 1] == "80" and argv[argv.index("--warmup-request-count") + 1] == "24"
    assert argv[argv.index("--random-seed") + 1] == "1" and "--no-server-metrics" in argv
    assert argv[argv.index("--isl") + 1] == "64" and argv[argv.index("--tokenizer") + 1] == "/tok"
    ds = aiperf.profile_argv("m", "u", "/tok", 1, Load(dataset="p.jsonl"), tmp_path, "u/metrics")
    assert "--input-file" in ds and "--isl" not in ds and ds[ds.index("--server-metrics") + 1] == "u/metrics"
    # AIPerf 0.13.0 refuses --warmup-request-count 0 ("Input should be greater than 0"): no flag is no warm-up
    assert "--warmup-request-count" not in aiperf.profile_argv("m", "u", "/tok", 4, Load(warmup_per_c=0), tmp_path, None)


def test_a_user_venv_with_the_wrong_aiperf_is_named_not_replaced(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "python3.11" / "site-packages" / "aiperf-0.12.1.dist-info"
    site.mkdir(parents=True)
    monkeypatch.setenv(aiperf.VENV_ENV, str(tmp_path))
    with pytest.raises(aiperf.BenchError, match=r"aiperf 0.12.1 there, railyard needs 0.13.0"):
        aiperf.ensure(log=lambda *_: None)
    assert site.exists()


def _png_text(path) -> dict:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, i = {}, 8
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[i + 8 + n:i + 12 + n])[0]
        if kind == b"tEXt":
            k, _, v = body.partition(b"\0")
            out[k.decode()] = v.decode("latin-1")
        i += 12 + n
    return out


class _Inv:
    path = "lab.yml"

    class head:
        vars: dict = {}


def _summary(tmp_path, slos=()):
    pts = [parse_export(export(f)) for f in ("local-lab-c1.profile_export_aiperf.json",
                                              "local-lab-c4.profile_export_aiperf.json")]

    class Plan:
        layout, deployment = "multinode_tp", "glm53-full"

        class endpoint:
            service, host, port, model = "head", "A", 8000, "m"
    return make_summary(_Inv(), Plan, "glm53-full", "20261201T000000Z", tmp_path,
                        Options(concurrency=[1, 4], slos=parse_slos(slos)), [Series("", None, None, pts)], None)


def test_plots_are_real_pngs_with_the_series_and_the_slo_they_draw(tmp_path):
    import matplotlib.image
    s = _summary(tmp_path, ["ttft_mean_s<=0.5", "per_user_tok_s>=400"])
    assert plot_all(s, tmp_path) == ["throughput.png", "latency.png"]
    for name in ("throughput.png", "latency.png"):
        img = matplotlib.image.imread(tmp_path / name)
        assert img.shape[0] > 300 and img.shape[1] > 500
    thr = json.loads(_png_text(tmp_path / "throughput.png")["railyard:series"])
    assert [p["concurrency"] for p in thr["this run"]] == [1, 4]
    assert thr["this run"][1]["output_tok_s"] > thr["this run"][0]["output_tok_s"]
    lat = json.loads(_png_text(tmp_path / "latency.png")["railyard:series"])
    assert set(lat["this run"]) == {"ttft_mean_s", "itl_mean_ms", "latency_mean_s"}
    assert lat["_slos"] == {"ttft_mean_s": ["ttft_mean_s<=0.5"]}


def test_the_table_the_verdicts_and_the_report(tmp_path):
    from rich.console import Console
    s = _summary(tmp_path, ["per_user_tok_s>=400"])
    con = Console(width=200, record=True)
    for t in view.tables(s):
        con.print(t)
    text = con.export_text()
    assert "overall tok/s" in text and "824.0" in text and "fail: per_user_tok_s>=400" in text
    assert str(view.verdict_lines(s)[0]) == "SLOs per_user_tok_s>=400: met up to C=1"
    assert view.report(s, require=False).exit_code == 0        # shown, not required
    rep = view.report(s, require=True)
    assert rep.exit_code == 1 and [c.status for c in rep.checks if c.check == "slo"] == ["pass", "fail"]
    s["_compare_doc"] = json.loads(json.dumps({k: v for k, v in s.items() if not k.startswith("_")}))
    s["_compare_doc"]["series"][0]["points"][1]["metrics"]["output_tok_s"] = 412.0
    s["compare"] = "earlier"
    con = Console(width=200, record=True)
    con.print(view.tables(s)[0])
    assert "824.0 (+100.0 %)" in con.export_text()


def test_concurrency_list():
    assert parse_concurrency("16,1,8,8") == [1, 8, 16]
    for bad in ("0", "a,b", ""):
        with pytest.raises(UsageError):
            parse_concurrency(bad)


@pytest.mark.parametrize("args, says", [
    (["--concurrency", "1,x"], "--concurrency '1,x': comma-separated whole numbers"),
    (["--slo", "ttft<=1"], "unknown metric 'ttft'"),
    (["--sweep", "max_num_bached_tokens=1,2"], "'max_num_bached_tokens' is no launch variable"),
    (["--sweep", "max_num_seqs"], "expected FLAG=V1,V2"),
    (["--sweep", "max_num_seqs=8,lots"], "--sweep max_num_seqs=8,lots: vllm_max_num_seqs=lots: must be an integer"),
    (["--compare", "/nonexistent/run"], "--compare /nonexistent/run: no summary.json there"),
    (["--dataset", "/nonexistent.jsonl"], "--dataset /nonexistent.jsonl: no such file"),
    (["--osl", "0"], "--osl 0: must be at least 1"),
])
def test_bad_input_is_one_line_exit_2_before_any_host(args, says):
    r = inv_cmd("bench", "--inventory", "inventory/dgx-stations.yml", *args)  # its hosts do not exist: no SSH
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and says in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""
