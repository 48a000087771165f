"""A successful `inv bench --sweep` on the two-station lab (the vLLM stand-in: a sweep relaunches once per
value and once more to restore, 2 s each here where the real engine takes a minute each): a series per value
in the output and in summary.json, each measured on an engine that runs the swept value (its processes' own
command line on A, read while AIPerf measures that value), and the inventory's configuration running again
after. The sweep's failures (a value that does not come up, Ctrl-C) are in test_lab_bench.py; what a sweep
relaunches with is `inv launch`, which test_lab_real_stations.py runs on the real engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, inv_cmd, processes_of, station_ready

pytestmark = pytest.mark.lab
NAME = "glm53-full"
SMALL = ("--isl", "64", "--osl", "16", "--requests", "2", "--warmup", "1")
FLAG = re.compile(r"--max-num-seqs[ =](\d+)")


def run(*args, inv, timeout=300):
    return inv_cmd(*args, env={"RAILYARD_INVENTORY": str(inv)}, timeout=timeout)


def engine_values() -> set[str]:
    """The --max-num-seqs of every engine process on A (the head: the endpoint)."""
    return {m[1] for c in processes_of("A", "--max-num-seqs") for m in [FLAG.search(c)] if m}


def test_a_sweep_measures_each_value_on_an_engine_running_it_and_puts_the_original_back(lab_inventory, tmp_path):
    with station_ready(lab_inventory) as inv:
        r = run("launch", inv=inv)
        assert r.returncode == 0, r.stdout + r.stderr
        original = engine_values()
        assert original == {"16"}, original          # the inventory's vllm_max_num_seqs
        p = subprocess.Popen([sys.executable, "-m", "invoke", "bench", "--concurrency", "2", *SMALL, "--out",
                              str(tmp_path), "--sweep", "max_num_seqs=1,4"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "RAILYARD_INVENTORY": str(inv)})
        err, label, during = "", None, {}
        assert p.stderr is not None
        for line in p.stderr:           # bench's progress: the relaunch of a value, then AIPerf measuring it
            err += line
            m = re.search(r"bench: (max_num_seqs=\d+): relaunching", line)
            if m:
                label = m[1]
            elif "bench: C=2:" in line and label and label not in during:
                during[label] = engine_values()
        out, rest = p.communicate(timeout=240)
        err += rest
        assert p.returncode == 0, out + err
        # each value measured on an engine started with it, and only it
        assert during == {"max_num_seqs=1": {"1"}, "max_num_seqs=4": {"4"}}, (during, err)
        assert "restoring the original configuration" in err and "Traceback" not in err

        s = json.loads(sorted(tmp_path.glob(f"{NAME}/*/summary.json"))[-1].read_text())
        assert [(x["label"], x["flag"], x["value"]) for x in s["series"]] == [
            ("max_num_seqs=1", "vllm_max_num_seqs", "1"), ("max_num_seqs=4", "vllm_max_num_seqs", "4")]
        assert s["restored"] is True
        for x in s["series"]:
            (pt,) = x["points"]
            assert pt["concurrency"] == 2 and pt["requests"] == 4 and pt["errors"] == 0, pt
            assert (Path(s["dir"]) / x["label"] / "c2" / "profile_export_aiperf.json").is_file()
        assert "max_num_seqs=1" in out and "max_num_seqs=4" in out, out     # a table per value

        # the original deployment back: the inventory's value in the engine, the configuration current
        assert engine_values() == original
        st = json.loads(run("status", "--json", inv=inv).stdout)
        assert st["ok"], st
