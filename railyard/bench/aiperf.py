"""AIPerf, the load generator of `inv bench`: its pinned virtualenv, one run's command, and the
parser of its export (`profile_export_aiperf.json`, schema 1.4 of aiperf 0.13.0).

The venv lives outside any checkout (RAILYARD_AIPERF_VENV; default /var/cache/railyard/venvs/
aiperf-<version> as root, else $XDG_CACHE_HOME/railyard/venvs/aiperf-<version>), made once on first
use and current while its marker holds exactly the pinned spec; it is never installed into a
serving image. `--where head` runs the venv at `bench_aiperf_venv` on the endpoint's host instead.

    point = parse_export(json.load(open("c8/profile_export_aiperf.json")))
    point.metrics["ttft_mean_s"], point.units["time_to_first_token"]   # 0.0412, "ms"
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RailyardError, UsageError

VERSION = "0.13.0"
SPEC = f"aiperf=={VERSION}\n"
MARKER = ".railyard-spec"
VENV_ENV = "RAILYARD_AIPERF_VENV"
EXPORT = "profile_export_aiperf.json"
READY = ".aiperf_results_ready.json"  # AIPerf's completion marker: {"ready", "was_cancelled", "partial"}
LAUNCHER = Path(__file__).resolve().parent / "aiperf_main.py"
# The environment AIPerf runs with: a local tokenizer directory is used as-is only with HF_HUB_OFFLINE
# unset (with it set, 0.13.0 hands the path to snapshot_download and fails); any stray hub call goes
# to a closed loopback port.
ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
UNSET = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OPENAI_API_KEY", "AIPERF_INJECTED_API_KEY")


class BenchError(RailyardError):
    """A benchmark that could not run or whose result cannot be trusted (exit 1)."""


SHARED = Path("/var/cache/railyard/venvs") / f"aiperf-{VERSION}"  # root's: the lab's hosts see it too


def venv_dir() -> Path:
    """RAILYARD_AIPERF_VENV; else, as root, SHARED (beside the lab's component venvs); else the user's cache."""
    if os.environ.get(VENV_ENV):
        return Path(os.environ[VENV_ENV])
    if os.geteuid() == 0:
        return SHARED
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "railyard" / "venvs" / f"aiperf-{VERSION}"


def python() -> Path:
    return venv_dir() / "bin" / "python"


def installed_version(d: Path | None = None) -> str | None:
    """The aiperf version in the venv (from its dist-info, no import), or None."""
    d = d or venv_dir()
    for info in sorted((d / "lib").glob("python3*/site-packages/aiperf-*.dist-info")):
        return info.name[len("aiperf-"):-len(".dist-info")]
    return None


def current() -> bool:
    d = venv_dir()
    try:
        return (d / MARKER).read_text() == SPEC and python().exists() and installed_version(d) == VERSION
    except OSError:
        return False


def ensure(log=print) -> Path:
    """The pinned AIPerf venv, made (about 2 minutes and 1.2 GB, once) or remade when it is not current.
    A venv named by RAILYARD_AIPERF_VENV is the user's: a wrong version there is an error, never replaced."""
    d = venv_dir()
    if current():
        return d
    if os.environ.get(VENV_ENV):
        have = installed_version(d)
        raise BenchError(f"{VENV_ENV}={d}: " + (f"aiperf {have} there, railyard needs {VERSION}" if have else
                         "no aiperf there") + f" (fix: {d}/bin/python -m pip install aiperf=={VERSION}, "
                         f"or unset {VENV_ENV} to let railyard make its own)")
    log(f"bench: installing aiperf=={VERSION} into {d} (about 2 minutes, once)")
    t0 = time.monotonic()
    shutil.rmtree(d, ignore_errors=True)
    d.parent.mkdir(parents=True, exist_ok=True)
    base = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    for argv, what in (([base, "-m", "venv", str(d)], "python3 -m venv (apt-get install python3-venv)"),
                       ([str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                         f"aiperf=={VERSION}"], f"pip install aiperf=={VERSION}")):
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode != 0:
            lines = [ln.strip() for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
            shutil.rmtree(d, ignore_errors=True)
            raise BenchError(f"bench: installing AIPerf failed: {what}: {last}")
    (d / MARKER).write_text(SPEC)
    log(f"bench: aiperf {VERSION} ready in {time.monotonic() - t0:.0f} s")
    return d


@dataclass(frozen=True)
class Load:
    """What one AIPerf run sends: synthetic prompts (isl/osl with spread, shared prefix) or a dataset file."""

    isl: int = 128
    osl: int = 64
    isl_stddev: int = 0
    osl_stddev: int = 0
    dataset: str | None = None       # a local file (AIPerf's single_turn JSONL: {"text": ...} per line)
    prefix_prompts: int = 0          # --num-prefix-prompts
    prefix_length: int = 0           # --prefix-prompt-length
    warmup_per_c: int = 3            # warm-up requests = warmup_per_c x C (excluded from the results)
    requests_per_c: int = 10         # measured requests = requests_per_c x C
    min_requests: int = 4
    seed: int = 1
    timeout_s: int = 600


def profile_argv(model: str, url: str, tokenizer: str, c: int, load: Load, out: Path,
                 server_metrics: str | None) -> list[str]:
    """`aiperf profile` for one concurrency, streaming, warm-up excluded, fixed seed (no key: see aiperf_main)."""
    argv = ["profile", "-m", model, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", tokenizer, "--concurrency", str(c),
            "--request-count", str(max(load.min_requests, load.requests_per_c * c)), "--random-seed", str(load.seed),
            "--request-timeout-seconds", str(load.timeout_s),
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--no-gpu-telemetry", "--ui", "none", "--artifact-dir", str(out)]
    if load.warmup_per_c:            # AIPerf 0.13 refuses a count of 0: no warm-up is the flag left out
        argv += ["--warmup-request-count", str(load.warmup_per_c * c)]
    if load.dataset:
        argv += ["--input-file", load.dataset, "--custom-dataset-type", "single_turn", "--osl", str(load.osl)]
    else:
        argv += ["--isl", str(load.isl), "--isl-stddev", str(load.isl_stddev),
                 "--osl", str(load.osl), "--osl-stddev", str(load.osl_stddev)]
        if load.prefix_prompts and load.prefix_length:
            argv += ["--num-prefix-prompts", str(load.prefix_prompts), "--prefix-prompt-length", str(load.prefix_length)]
    argv += ["--server-metrics", server_metrics] if server_metrics else ["--no-server-metrics"]
    return argv


def run_profile(argv: list[str], key: str, out: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run AIPerf with the key on a pipe (railyard/bench/aiperf_main.py); its output goes to out/aiperf.out."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(ENV)
    r, w = os.pipe()
    os.write(w, key.encode())
    os.close(w)
    try:
        with open(out / "aiperf.out", "w") as log:
            p = subprocess.run([str(python()), "-I", str(LAUNCHER), str(r), *argv], stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, pass_fds=(r,), env=env, timeout=timeout, text=True)
    except subprocess.TimeoutExpired:
        raise BenchError(f"AIPerf ran past {timeout:.0f} s (its output: {out / 'aiperf.out'})")
    finally:
        os.close(r)
    return p


# ---------------------------------------------------------------- the export

# railyard's names -> (AIPerf tag, statistic, the unit railyard reports in)
METRICS = {
    "output_tok_s": ("output_token_throughput", "avg", "tokens/sec"),
    "per_user_tok_s": ("output_token_throughput_per_user", "avg", "tokens/sec/user"),
    "request_s": ("request_throughput", "avg", "requests/sec"),
    "ttft_mean_s": ("time_to_first_token", "avg", "s"),
    "ttft_p50_s": ("time_to_first_token", "p50", "s"),
    "ttft_p90_s": ("time_to_first_token", "p90", "s"),
    "ttft_p99_s": ("time_to_first_token", "p99", "s"),
    "itl_mean_ms": ("inter_token_latency", "avg", "ms"),
    "itl_p90_ms": ("inter_token_latency", "p90", "ms"),
    "itl_p99_ms": ("inter_token_latency", "p99", "ms"),
    "latency_mean_s": ("request_latency", "avg", "s"),
    "latency_p90_s": ("request_latency", "p90", "s"),
    "isl_mean": ("input_sequence_length", "avg", "tokens"),
    "osl_mean": ("output_sequence_length", "avg", "tokens"),
}
# vLLM's TPOT is AIPerf's inter-token latency (decode time / (output tokens - 1))
ALIASES = {"tpot_mean_ms": "itl_mean_ms", "tpot_p90_ms": "itl_p90_ms", "tpot_p99_ms": "itl_p99_ms"}
_SCALE = {("ms", "s"): 1e-3, ("s", "ms"): 1e3, ("sec", "ms"): 1e3, ("sec", "s"): 1.0, ("ns", "ms"): 1e-6,
          ("ns", "s"): 1e-9, ("us", "ms"): 1e-3, ("us", "s"): 1e-6}


@dataclass
class Point:
    """One concurrency's result, in railyard's units (converted from the units the export names)."""

    concurrency: int
    metrics: dict[str, float | None]
    requests: int
    errors: int
    duration_s: float | None
    units: dict[str, str] = field(default_factory=dict)   # AIPerf tag -> the unit it was exported in
    aiperf_version: str = ""
    error_summary: list = field(default_factory=list)


def _convert(value, unit: str, want: str):
    if value is None:
        return None
    unit = unit.strip()
    if unit == want or (unit, want) in (("tokens/sec", "tokens/sec"),):
        return float(value)
    if (unit, want) in _SCALE:
        return float(value) * _SCALE[(unit, want)]
    raise ValueError(f"unit {unit!r} cannot be read as {want!r}")


def parse_export(doc: dict, concurrency: int | None = None) -> Point:
    """profile_export_aiperf.json -> Point. A tag AIPerf leaves out (per-user throughput with one token
    per request, the error count with no errors) is None, or 0 errors; units are read from the file."""
    if not isinstance(doc, dict) or "aiperf_version" not in doc:
        raise ValueError("not an AIPerf profile export (no aiperf_version)")
    metrics: dict[str, float | None] = {}
    units: dict[str, str] = {}
    for name, (tag, stat, want) in METRICS.items():
        m = doc.get(tag)
        if not isinstance(m, dict):
            metrics[name] = None
            continue
        units[tag] = str(m.get("unit", ""))
        metrics[name] = _convert(m.get(stat), units[tag], want)
    if concurrency is None:
        phases = (doc.get("input_config") or {}).get("phases") or []
        prof = [p for p in phases if isinstance(p, dict) and p.get("kind", p.get("name")) == "profiling"]
        concurrency = int((prof or phases or [{}])[0].get("concurrency") or 0)

    def avg(tag):
        m = doc.get(tag)
        return m.get("avg") if isinstance(m, dict) else None

    errors = int(avg("error_request_count") or 0)
    done = avg("request_count")
    dur = doc.get("benchmark_duration")
    return Point(concurrency, metrics, int(done or 0), errors,
                 _convert(avg("benchmark_duration"), str(dur.get("unit", "sec")), "s") if isinstance(dur, dict) else None,
                 units, str(doc.get("aiperf_version", "")), list(doc.get("error_summary") or []))


def record_errors(jsonl: str) -> dict[str, int]:
    """profile_export.jsonl (one record per request) -> {"HTTP 401 Unauthorized: <message>": count}, the
    measured phase's errors (all phases' when none was measured)."""
    by_phase: dict[str, dict[str, int]] = {}
    for line in jsonl.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        err = rec.get("error") if isinstance(rec, dict) else None
        if not isinstance(err, dict):
            continue
        phase = str((rec.get("metadata") or {}).get("benchmark_phase", ""))
        what = (f"HTTP {err['code']} " if err.get("code") else "") + str(err.get("type") or "error")
        msg = str(err.get("message") or "").strip()
        key = f"{what}: {msg[:160]}" if msg else what
        by_phase.setdefault(phase, {})[key] = by_phase.setdefault(phase, {}).get(key, 0) + 1
    if "profiling" in by_phase:
        return by_phase["profiling"]
    out: dict[str, int] = {}
    for errs in by_phase.values():
        for k, n in errs.items():
            out[k] = out.get(k, 0) + n
    return out


def value(point: Point, name: str) -> float | None:
    return point.metrics.get(ALIASES.get(name, name))


def known_metric(name: str) -> bool:
    return name in METRICS or name in ALIASES


def check_usage(load: Load) -> None:
    for k in ("isl", "osl", "warmup_per_c", "requests_per_c"):
        if getattr(load, k) < (0 if k == "warmup_per_c" else 1):
            raise UsageError(f"--{k.replace('_', '-')} {getattr(load, k)}: must be at least "
                             f"{0 if k == 'warmup_per_c' else 1}")
    if load.dataset and not Path(load.dataset).is_file():
        raise UsageError(f"--dataset {load.dataset}: no such file")
