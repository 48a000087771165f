"""`inv bench`: AIPerf against the plan's endpoint (the head, the router or the proxy), one run per
concurrency, from the control machine.

    bench(inv, Options(concurrency=[1, 8, 16, 32], slos=[...]))   # -> Summary, written under bench/

Before any load: the endpoint's /health (down: run `inv health`) and an authenticated /v1/models
(401/403: the key is refused), both from the endpoint's host with the key from its file there
(railyard.transport.http). The key then travels to AIPerf on a pipe (railyard/bench/aiperf_main.py),
never in argv, a log or the summary. AIPerf reaches the endpoint through an SSH tunnel when it
listens on loopback, else directly. The tokenizer is the checkpoint's own files, copied from the
host (offline; no hub at run time). With a sweep, each value of one launch flag is a relaunch
(`inv env` + `inv launch --recreate`, gated) and a full set of concurrencies; the original
configuration is launched again at the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import io
import json
import shutil
import socket
import tarfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from invoke.exceptions import ThreadException

from ..apply.executor import Show
from ..verbs import serve as launching
from ..errors import UsageError
from ..inventory import Inventory, load_inventory
from ..facts.docker import inspect
from ..transport.http import request
from ..render.docker import config_hash
from ..transport.runner import Runner
from ..plan import layout as layouts
from ..plan.spec import Endpoint, LaunchPlan
from ..transport import CommandFailed, RemotePath, Session, cmd, q, read_remote, write_remote
from . import aiperf
from .aiperf import BenchError, Load, Point
from .slo import Slo, best_concurrency, verdicts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
SUMMARY = "summary.json"


@dataclass
class Options:
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 16, 32])
    load: Load = field(default_factory=Load)
    slos: list[Slo] = field(default_factory=list)
    sweep: tuple[str, list[str]] | None = None   # (inventory variable, values)
    compare: dict | None = None                  # an earlier run's summary
    out: Path = Path("bench")
    tokenizer: str | None = None                 # a local tokenizer directory instead of the checkpoint's
    start_timeout: float | None = None
    where: str | None = None                     # control or head (None: bench_where)


@dataclass
class Series:
    label: str                    # "" for a plain run, else FLAG=VALUE
    flag: str | None
    value: str | None
    points: list[Point]


def parse_concurrency(text: str) -> list[int]:
    try:
        got = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--concurrency {text!r}: comma-separated whole numbers, e.g. 1,8,16,32")
    if not got or any(c < 1 for c in got):
        raise UsageError(f"--concurrency {text!r}: each at least 1")
    return sorted(set(got))


def parse_sweep(text: str, inv: Inventory) -> tuple[str, list[str]]:
    """`max_num_batched_tokens=2048,8192` -> ("vllm_max_num_batched_tokens", [...]); the variable must exist."""
    name, sep, values = (text or "").partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.strip() or not vals:
        raise UsageError(f"--sweep {text!r}: expected FLAG=V1,V2,... (e.g. max_num_batched_tokens=2048,8192)")
    name = name.strip().replace("-", "_")
    known = inv.head.vars
    var = name if name in known else f"vllm_{name}" if f"vllm_{name}" in known else None
    if var is None:
        raise UsageError(f"--sweep {text!r}: {name!r} is no launch variable (e.g. max_num_batched_tokens, "
                         "max_num_seqs, or any vllm_* variable)")
    return var, vals


def load_compare(path: str) -> dict:
    p = Path(path)
    f = p / SUMMARY if p.is_dir() else p
    try:
        doc = json.loads(f.read_text())
    except OSError:
        raise UsageError(f"--compare {path}: no {SUMMARY} there (a run directory of `inv bench`)")
    except ValueError as e:
        raise UsageError(f"--compare {path}: {f} is not JSON ({e})")
    if not isinstance(doc, dict) or not isinstance(doc.get("series"), list):
        raise UsageError(f"--compare {path}: {f} is no `inv bench` summary (no series)")
    doc["_path"] = str(f.parent)
    return doc


# ---------------------------------------------------------------- the endpoint, its key, its tokenizer

def _check_endpoint(s: Session, ep: Endpoint) -> None:
    code, _, text, _ = request(s, ep, "/health", timeout=10)
    if code != 200:
        raise BenchError(f"endpoint down: {ep.service} on {ep.host} ({ep.local_address}:{ep.port}) answers /health with "
                         f"{f'HTTP {code}' if code else text.strip()[:160]} (run `inv health`)")
    code, _, text, _ = request(s, ep, "/v1/models", timeout=10)
    if code in (401, 403):
        raise BenchError(f"auth refused: {ep.service} on {ep.host} answers HTTP {code} with the key from "
                         f"{ep.api_key_file or '(no key file)'} (check the key, `inv env`, `inv launch`)")
    if code != 200:
        raise BenchError(f"endpoint {ep.service} on {ep.host}: /v1/models answers HTTP {code}: {text.strip()[:160]}")


def _check_current(runner: Runner, plan: LaunchPlan) -> None:
    """Every service runs the inventory's configuration (its railyard.config label): numbers for
    another configuration would be presented as this one's."""
    stale = []
    for svc in plan.services():
        c = inspect(runner.session(svc.host), svc.spec.name)
        if c.exists and c.running and c.config and c.config != config_hash(plan, svc):
            stale.append(f"{svc.spec.name} on {svc.host}")
    if stale:
        raise BenchError(f"{', '.join(stale)} run(s) another configuration than the inventory's: the numbers would "
                         "not be this deployment's (run `inv launch --recreate`, or `inv status` to see which)")


def _key(s: Session, ep: Endpoint) -> str:
    if not ep.api_key_file:
        return ""
    try:
        text = read_remote(s, ep.api_key_file)
    except CommandFailed as e:
        raise BenchError(f"{ep.host}: cannot read the API key file {ep.api_key_file}: {e}")
    if not text or not text.strip():
        raise BenchError(f"{ep.host}: the API key file {ep.api_key_file} is missing or empty (run `inv launch`)")
    return text.strip()


def fetch_tokenizer(s: Session, model_path: str, dest: Path) -> Path:
    """The checkpoint's tokenizer files from the host into dest (base64 over the session: binary-safe)."""
    dest.mkdir(parents=True, exist_ok=True)
    base = RemotePath(model_path.rstrip("/"))
    script = "; ".join(f"if [ -f {q(RemotePath(base + '/' + n))} ]; then echo '@@{n}'; base64 < {q(RemotePath(base + '/' + n))}; fi"
                       for n in TOKENIZER_FILES)
    r = s.run(script, timeout=120)
    if r.error:
        raise BenchError(f"{s.host.name}: cannot read the tokenizer under {model_path}: {r.error}")
    got = []
    for block in r.stdout.split("@@")[1:]:
        name, _, body = block.partition("\n")
        if name in TOKENIZER_FILES:
            (dest / name).write_bytes(base64.b64decode(body))
            got.append(name)
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(got):
        raise BenchError(f"{s.host.name}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json) under "
                         f"{model_path}: synthetic prompts need the checkpoint's tokenizer (or pass --tokenizer DIR)")
    return dest


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


@contextlib.contextmanager
def reach(s: Session, ep: Endpoint):
    """The endpoint's base URL from this machine: a loopback bind through an SSH tunnel, else direct."""
    if ep.local_address.startswith("127.") or ep.local_address in ("::1", "localhost"):
        conn = getattr(s, "_conn", None)
        if s.host.is_local:
            yield f"http://{ep.local_address}:{ep.port}"
            return
        if conn is None:
            raise BenchError(f"{ep.host}: no SSH connection for the tunnel to {ep.local_address}:{ep.port}")
        port = _free_port()
        try:
            with conn.forward_local(port, remote_port=ep.port, remote_host=ep.local_address, local_host="127.0.0.1"):
                yield f"http://127.0.0.1:{port}"
        except ThreadException as e:
            # a tunnel thread saw a client drop its socket (AIPerf closing its connections as it ends); the run's
            # own records say how the requests went. Anything else is the tunnel failing.
            gone = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
            other = [x.value for x in e.exceptions if not isinstance(x.value, gone)]
            if other:
                raise BenchError(f"{ep.host}: the SSH tunnel to {ep.local_address}:{ep.port} failed: "
                                 f"{type(other[0]).__name__}: {other[0]}") from None
        return
    addr = s.host.address if ep.bind in ("0.0.0.0", "::", "") else ep.bind
    yield f"http://{addr}:{ep.port}"


# ---------------------------------------------------------------- one series

class _Local:
    """AIPerf on this machine, the key on a pipe."""

    def __init__(self, key: str):
        self.key = key

    def artifact_dir(self, d: Path) -> str:
        return str(d)

    def run(self, argv: list[str], d: Path, timeout: float) -> int:
        return aiperf.run_profile(argv, self.key, d, timeout).returncode


class _OnHost:
    """AIPerf on the endpoint's host (bench_aiperf_venv there): the key file opened on its fd 3 by the
    host's shell, so the key never leaves the host; each run's files are copied back into c<C>/."""

    def __init__(self, s: Session, venv: str, key_file: str):
        self.s, self.venv, self.key_file = s, venv.rstrip("/"), key_file
        r = s.run(f"ls -d {q(RemotePath(self.venv))}/lib/python3*/site-packages/aiperf-*.dist-info 2>/dev/null; "
                  f"test -x {q(RemotePath(self.venv))}/bin/python && echo @@python", timeout=30)
        names = [ln.rsplit("/", 1)[-1] for ln in r.stdout.splitlines() if ln.endswith(".dist-info")]
        have = names[0][len("aiperf-"):-len(".dist-info")] if names else None
        if r.error or "@@python" not in r.stdout or have != aiperf.VERSION:
            raise BenchError(f"{s.host.name}: bench_aiperf_venv {venv}: " + (f"aiperf {have} there, railyard needs "
                             f"{aiperf.VERSION}" if have else "no AIPerf there") + f" (install it on {s.host.name}: "
                             f"python3 -m venv {venv} && {venv}/bin/pip install aiperf=={aiperf.VERSION}; or run "
                             "from this machine: --where control)")
        t = s.run("mktemp -d /tmp/railyard-bench.XXXXXX", timeout=30)
        if not t.ok or not t.stdout.strip():
            raise BenchError(f"{s.host.name}: cannot make a temporary directory: {t.error or t.stderr.strip()}")
        self.tmp = t.stdout.strip()
        write_remote(s, f"{self.tmp}/aiperf_main.py", aiperf.LAUNCHER.read_text(), mode="700")

    def artifact_dir(self, d: Path) -> str:
        return f"{self.tmp}/{d.parent.name}-{d.name}"

    def run(self, argv: list[str], d: Path, timeout: float) -> int:
        rd = self.artifact_dir(d)
        env = "env " + " ".join(f"-u {k}" for k in aiperf.UNSET) + " " + " ".join(
            f"{k}={q(v)}" for k, v in aiperf.ENV.items())
        key = q(RemotePath(self.key_file)) if self.key_file else "/dev/null"
        line = (f"mkdir -p {q(rd)} && {env} {q(RemotePath(self.venv))}/bin/python -I {q(self.tmp)}/aiperf_main.py 3 "
                f"{cmd(*argv)} 3< {key} > {q(rd)}/aiperf.out 2>&1 < /dev/null; echo \"@@rc $?\"")
        r = self.s.run(line, timeout=timeout)
        if r.error:
            raise BenchError(f"{self.s.host.name}: AIPerf over SSH: {r.error}")
        rc = int(r.stdout.rsplit("@@rc ", 1)[-1].strip() or 1) if "@@rc " in r.stdout else 1
        got = self.s.run(f"tar -C {q(rd)} -cf - . | base64", timeout=300)
        if not got.ok:
            raise BenchError(f"{self.s.host.name}: cannot copy AIPerf's files from {rd}: {got.stderr.strip()[:200]}")
        d.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(got.stdout)), mode="r:") as tf:
            tf.extractall(d, filter="data")
        return rc

    def close(self) -> None:
        self.s.run(f"rm -rf {q(self.tmp)}", timeout=60)


def _point(runner, url: str, tok: str, model: str, c: int, opts: Options, out: Path, metrics_url: str | None,
           log) -> Point:
    d = out / f"c{c}"
    shutil.rmtree(d, ignore_errors=True)
    argv = aiperf.profile_argv(model, url, tok, c, opts.load, runner.artifact_dir(d), metrics_url)
    log(f"bench: C={c}: {max(opts.load.min_requests, opts.load.requests_per_c * c)} requests "
        f"(+{opts.load.warmup_per_c * c} warm-up) -> {d}")
    rc = runner.run(argv, d, timeout=opts.load.timeout_s * 4 + 600)
    export = d / aiperf.EXPORT
    try:
        ready = json.loads((d / aiperf.READY).read_text())
    except (OSError, ValueError):
        ready = {}
    tail = (d / "aiperf.out").read_text(errors="replace").strip().splitlines()[-3:] if (d / "aiperf.out").exists() else []
    records = d / "profile_export.jsonl"
    if rc != 0 and not export.exists() and records.exists():
        errs = aiperf.record_errors(records.read_text(errors="replace"))
        if errs:  # AIPerf exports nothing when no request succeeded
            n = sum(errs.values())
            what, count = max(errs.items(), key=lambda kv: kv[1])
            raise BenchError(f"every request failed at C={c}: {count} of {n} with {what}"
                             + (" (the key is refused: check it on the endpoint's host)" if what.startswith(("HTTP 401",
                                                                                                      "HTTP 403"))
                                else "") + f" (records: {records})")
    if rc != 0 or not ready.get("ready") or ready.get("partial") or ready.get("was_cancelled") \
            or not export.exists():
        raise BenchError(f"AIPerf at C={c} did not finish (exit {rc}, {aiperf.READY}: {ready or 'missing'}): "
                         + (" | ".join(x.strip() for x in tail) or "no output") + f" (see {d / 'aiperf.out'})")
    try:
        point = aiperf.parse_export(json.loads(export.read_text()), c)
    except ValueError as e:
        raise BenchError(f"{export}: {e}")
    if point.requests == 0 and point.errors:
        first = point.error_summary[0] if point.error_summary else {}
        raise BenchError(f"every request failed at C={c} ({point.errors} errors"
                         + (f", e.g. {json.dumps(first)[:200]}" if first else "") + f"; see {d})")
    return point


def _series(inv: Inventory, opts: Options, out: Path, label: str, log) -> tuple[LaunchPlan, list[Point]]:
    with Runner(layouts.get(inv).hosts(inv)) as runner:
        plan = launching.build_plan(inv, runner, strict=False)
        ep = plan.endpoint
        s = runner.session(ep.host)
        err = s.connect()
        if err:
            raise BenchError(f"{ep.host}: {err}")
        _check_current(runner, plan)
        _check_endpoint(s, ep)
        # vLLM's /metrics (AIPerf keeps it as server_metrics_export.json); LiteLLM's needs the key, the pd proxy has none
        scrape = plan.service(ep.service).role not in ("router", "proxy")
        points = []
        if (opts.where or inv.head.vars.get("bench_where") or "control") == "head":
            tok = opts.tokenizer or _host_dir(s, inv.head.vars["model_path"])
            host = _OnHost(s, str(inv.head.vars.get("bench_aiperf_venv") or aiperf.SHARED), ep.api_key_file)
            url = f"http://{ep.local_address}:{ep.port}"
            try:
                for c in opts.concurrency:
                    points.append(_point(host, url, tok, ep.model, c, opts, out, url + "/metrics" if scrape else None,
                                         log))
            finally:
                host.close()
            return plan, points
        key = _key(s, ep)
        tok = opts.tokenizer or str(fetch_tokenizer(s, inv.head.vars["model_path"], out / "tokenizer"))
        with reach(s, ep) as url:
            for c in opts.concurrency:
                points.append(_point(_Local(key), url, tok, ep.model, c, opts, out,
                                     url + "/metrics" if scrape else None, log))
    return plan, points


def _host_dir(s: Session, path: str) -> str:
    """A directory's absolute path on the host (model_path may start with ~/)."""
    r = s.run(f"cd {q(RemotePath(path.rstrip('/')))} && pwd", timeout=30)
    if not r.ok or not r.stdout.strip():
        raise BenchError(f"{s.host.name}: no checkpoint directory {path} for the tokenizer")
    return r.stdout.strip().splitlines()[-1]


def _relaunch(inv: Inventory, timeout: float | None, show: Show | None, what: str) -> None:
    launching.env(inv, False)
    rep = launching.launch(inv, None, False, True, timeout, False, show)
    if not rep.ok:
        raise BenchError(f"{what}: the launch failed on {rep.failed_rank or '-'}"
                         f"{' (' + rep.failed_service + ')' if rep.failed_service else ''}: {rep.failure}")


def bench(inv: Inventory, opts: Options, overrides=None, show: Show | None = None, log=print) -> dict:
    """Run the benchmark, write bench/<deployment>/<stamp>/ (AIPerf's exports per c<C>, summary.json,
    the PNG plots) and return the summary."""
    if (opts.where or inv.head.vars.get("bench_where") or "control") == "control":
        aiperf.ensure(log)  # --where head uses the host's own venv
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    deployment = launching.build_plan(inv, None, strict=False).deployment  # no SSH: the name only
    root = opts.out / deployment / stamp
    root.mkdir(parents=True, exist_ok=True)
    series: list[Series] = []
    restored = None
    plan = None
    try:
        if opts.sweep is None:
            plan, pts = _series(inv, opts, root, "", log)
            series.append(Series("", None, None, pts))
        else:
            var, values = opts.sweep
            for v in values:
                label = f"{var.removeprefix('vllm_')}={v}"
                log(f"bench: {label}: relaunching")
                swept = load_inventory(inv.path, list(overrides or []) + [f"{var}={v}"])
                _relaunch(swept, opts.start_timeout, show, label)
                plan, pts = _series(swept, opts, root / label, label, log)
                series.append(Series(label, var, v, pts))
    finally:
        if opts.sweep is not None:
            log("bench: restoring the original configuration")
            try:
                _relaunch(inv, None, show, "restore")  # the inventory's own start timeout
                restored = True
            except BaseException as e:  # the restore's own failure is reported, never hidden
                restored = False
                log(f"bench: restore FAILED: {e} (run `inv launch --recreate`)")
                if not isinstance(e, Exception):
                    raise
    summary = make_summary(inv, plan, deployment, stamp, root, opts, series, restored)
    if opts.compare:
        summary["_compare_doc"] = opts.compare   # for the table and the plots; not written
    from .plots import plot_all
    summary["plots"] = plot_all(summary, root)
    (root / SUMMARY).write_text(json.dumps({k: v for k, v in summary.items() if not k.startswith("_")}, indent=2) + "\n")
    return summary


def _point_doc(p: Point, root: Path, series_dir: Path) -> dict:
    return {"concurrency": p.concurrency, "requests": p.requests, "errors": p.errors, "duration_s": p.duration_s,
            "metrics": p.metrics, "units": p.units, "dir": str((series_dir / f"c{p.concurrency}").relative_to(root))}


def make_summary(inv, plan, deployment, stamp, root, opts: Options, series: list[Series], restored) -> dict:
    ep = plan.endpoint if plan else None
    docs: list[dict[str, Any]] = []
    for s in series:
        sdir = root / s.label if s.label else root
        vs = verdicts(s.points, opts.slos)
        docs.append({"label": s.label, "flag": s.flag, "value": s.value,
                     "points": [_point_doc(p, root, sdir) for p in s.points],
                     "verdicts": [asdict(v) for v in vs],
                     "best_concurrency": best_concurrency(s.points, opts.slos)})
    slo_ok = all(v["ok"] for d in docs for v in d["verdicts"])
    return {"deployment": deployment, "layout": plan.layout if plan else None, "stamp": stamp, "dir": str(root),
            "endpoint": {"service": ep.service, "host": ep.host, "port": ep.port, "model": ep.model} if ep else None,
            "aiperf_version": next((p.aiperf_version for s in series for p in s.points), aiperf.VERSION),
            "load": asdict(replace(opts.load)), "concurrency": opts.concurrency,
            "slos": [str(x) for x in opts.slos], "slo_ok": slo_ok, "series": docs,
            "restored": restored, "compare": opts.compare.get("_path") if opts.compare else None,
            "where": opts.where or inv.head.vars.get("bench_where") or "control",
            "inventory": str(inv.path)}
