"""What each `inv` task does. tasks.py parses the flags and calls one function here.

Every function returns an exit code; `entry` turns expected failures into one line on
stderr and that code (2 for usage and inventory errors), never a traceback. Every `--json`
output is a railyard.report.Report (its docstring has the contract and the exit codes).
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys

from invoke.exceptions import Exit
from rich.table import Table
from rich.text import Text

from ..errors import InventoryError, RailyardError
from ..inventory import Inventory, load_inventory
from ..report import (console, error_report, health_report, nccl_report, plan_report, print_checks, rdma_report,
                      recover_report, status_report, sync_report, verdict_table)


def entry(fn):
    """Run a task body: expected errors become a message and an exit code. Under --json an error
    that is not a usage error (exit 1) also prints the task's one document, with one failed check."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
        except InventoryError as e:
            for p in e.problems:
                print(f"error: {p}", file=sys.stderr)
            raise Exit(code=e.exit_code)
        except RailyardError as e:
            print(f"error: {e}", file=sys.stderr)
            if e.exit_code == 1 and _json_out(sig, args, kwargs):
                error_report(fn.__name__, str(e)).print_json()
            raise Exit(code=e.exit_code)
        except KeyboardInterrupt:
            # the task's own cleanup (its lock, the live display) ran on the way up; the threads still
            # waiting on remote commands are not waited for: leaving drops their connections, and what
            # ran on a host over them ends with them (rsync on its next write), as after ssh's ^C
            print("interrupted: what had started on the hosts is as it was; run the task again to resume "
                  "(`inv status` shows what runs)", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        if code:
            raise Exit(code=code)
    return wrapper


def _json_out(sig: inspect.Signature, args, kwargs) -> bool:
    try:
        return bool(sig.bind(*args, **kwargs).arguments.get("json_out"))
    except TypeError:
        return False


def number(value, flag: str, kind=int):
    """A numeric flag from invoke (which hands over strings); a bad one is a usage error, exit 2."""
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        print(f"error: {flag} {value!r}: not a number", file=sys.stderr)
        raise Exit(code=2)


def _inventory(path: str | None, overrides) -> Inventory:
    return load_inventory(path, overrides)


@entry
def preflight(inventory: str | None = None, json_out: bool = False, overrides=None) -> int:
    from ..verbs.preflight import run_preflight
    inv = _inventory(inventory, overrides)
    if json_out:
        return print_checks(run_preflight(inv), True, "")
    err = console(stderr=True)
    err.print(f"preflight: {len(inv.hosts)} host(s) from {inv.path}", style="dim")
    waiting = [h.name for h in inv.hosts]
    with err.status(f"probing {len(waiting)} host(s)") as status:
        def landed(name: str, probe) -> None:
            waiting.remove(name)
            ssh = getattr(probe, "ssh", None)
            if ssh is not None and ssh.status != "pass":  # say it now; the other hosts' probes go on
                err.print(f"preflight: {name}: {ssh.detail}", style="red", markup=False)
            status.update(f"probed {len(inv.hosts) - len(waiting)} of {len(inv.hosts)} host(s); "
                          + ("waiting for " + ", ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else "")
                             if waiting else "judging"))
        results = run_preflight(inv, landed)
    return print_checks(results, False, f"railyard preflight — {inv.path.name}")


@entry
def trust_hosts(inventory: str | None = None, hosts: str | None = None, accept: bool = False,
                replace: bool = False, overrides=None) -> int:
    from ..transport.hostkeys import record, scan_all
    inv = _inventory(inventory, overrides)
    statuses = scan_all(inv.select(hosts))
    t = Table(title="SSH host keys", title_justify="left")
    for col in ("host", "known_hosts name", "key", "fingerprint", "status"):
        t.add_column(col, no_wrap=col != "status")
    code = 0
    for st in statuses:
        action: str = st.status
        if st.status == "unknown" and accept:
            record(st)
            action = "recorded"
        elif st.status == "changed" and replace:
            record(st)
            action = "replaced"
        elif st.status in ("unknown", "changed", "unreachable"):
            code = 1
        style = {"known": "green", "recorded": "green", "replaced": "yellow", "unknown": "yellow"}.get(action, "bold red")
        t.add_row(st.host, st.name, st.key.get_name() if st.key else "-", st.fingerprint or "-",
                  Text(f"{action}: {st.detail}", style=style))
    con = console()
    con.print(t)
    if any(s.status == "unknown" for s in statuses) and not accept:
        con.print("Compare each fingerprint with the host's own (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` "
                  "on its console); then record them with --accept.", style="yellow")
    if any(s.status == "changed" for s in statuses) and not replace:
        con.print("A CHANGED key means the host was reinstalled or someone is in the middle. Verify it out of band, "
                  "then replace it with --replace.", style="bold red")
    return code


@entry
def sync_model(inventory: str | None = None, source: str | None = None, to: str | None = None,
               verify: str | None = None, streams: int | None = None, dry_run: bool = False, repair: bool = False,
               json_out: bool = False, rehash: bool = False, bwlimit: float | None = None, overrides=None,
               transport: str | None = None) -> int:
    from ..verbs.sync import SyncOptions, print_report
    from ..verbs.sync import sync_model as run
    inv = _inventory(inventory, overrides)
    con = console(stderr=json_out)
    opts = SyncOptions(source, to, verify, streams, dry_run, repair, rehash, bwlimit, transport)
    rep = run(inv, opts, con)
    report = sync_report(rep)
    if json_out:
        return report.print_json()
    print_report(rep, console())
    return report.exit_code


@entry
def env(inventory: str | None = None, check: bool = False, overrides=None) -> int:
    from ..verbs.serve import env as run
    inv = _inventory(inventory, overrides)
    con = console()
    files, written = run(inv, check)
    for f in files:
        if f.changed:
            con.print(f.diff(), highlight=False, markup=False, end="")
        else:
            con.print(f"{f.host}: {f.path} is current", style="green")
    if check:
        changed = [f.host for f in files if f.changed]
        con.print(f"--check: {len(changed)} file(s) would change ({', '.join(changed) or 'none'}); nothing written "
                  "to the hosts", style="bold")
        return 1 if changed else 0
    where = files[0].local
    assert where is not None  # plan_env gives each file its local path, and write_local wrote it there
    con.print(f"rendered {len(files)} env file(s) into {where.parent}/; written on: "
              f"{', '.join(written) or 'none (all current)'}")
    return 0


def _print_timeline(rep, con) -> None:
    from ..report import timeline_table
    if not rep.timeline:
        return
    con.print(timeline_table(rep.timeline))
    if rep.timeline_previous:
        con.print(f"previous launch: {rep.timeline_previous['written_at']} by {rep.timeline_previous['by']}",
                  style="dim", markup=False)
    if rep.timeline_file:
        con.print(f"kept for the next launch: {rep.timeline_file}", style="dim", markup=False)
    if rep.timeline_note:
        con.print(rep.timeline_note, style="yellow", markup=False)


def _print_launch(rep, con, what: str) -> int:
    from rich.text import Text
    _print_timeline(rep, con)
    if rep.failure:
        con.print(Text(f"FAILED: {rep.failure}", style="bold red"))
        for host, text in rep.logs.items():
            con.print(Text(f"--- last lines of {host}'s log ---", style="bold"))
            con.print(text.rstrip() or "(empty)", highlight=False, markup=False)
        if rep.rolled_back:
            con.print(f"rolled back (stopped and removed) on: {', '.join(rep.rolled_back)}")
        con.print(Text(f"fix: {rep.hint}", style="cyan"))
        return 1
    if rep.noop:
        con.print(Text(f"{what}: already running with this configuration on {', '.join(rep.order)}: nothing to do",
                       style="green"))
        return 0
    if rep.kept:
        con.print(f"kept, already running with this configuration: {', '.join(rep.kept)}")
    if rep.proof:
        con.print(Text(f"P->D path: {rep.proof}", style="green"))
    ep = rep.plan.endpoint
    key = f"the key is in {ep.api_key_file} on {ep.host}" if ep.api_key_file else "it takes no API key"
    con.print(Text(f"{what}: ready in {rep.ready_seconds:.1f} s ({' -> '.join(rep.order)}); API {rep.api} ({key})",
                   style="bold green"))
    return 0


@entry
def launch(inventory: str | None = None, rank_order: str | None = None, dry_run: bool = False, recreate: bool = False,
           timeout: float | None = None, rollback: bool = False, overrides=None, json_out: bool = False) -> int:
    from ..verbs.serve import launch as run
    from ..report import launch_report
    inv = _inventory(inventory, overrides)
    con = console(stderr=json_out)  # --json: the live table on stderr, the one document on stdout
    rep = run(inv, rank_order, dry_run, recreate, timeout, rollback, con)
    if json_out:
        return launch_report(rep, dry_run).print_json()
    for note in rep.plan.notes if rep.plan else ():   # what vLLM will do other than asked, without failing
        con.print(f"note: {note}", style="yellow", markup=False)
    if dry_run:
        from ..apply.executor import describe
        assert rep.plan is not None  # a dry run's report always carries its plan
        for svc in rep.plan.services():
            con.print(f"# {describe(svc)}", style="bold")
            con.print(rep.commands[svc.name], highlight=False, markup=False, soft_wrap=True)
        if rep.hint:
            con.print(rep.hint, style="yellow")
        con.print("dry run: nothing was changed", style="bold")
        return 0
    return _print_launch(rep, con, "launch")


@entry
def start(inventory: str | None = None, rank_order: str | None = None, timeout: float | None = None,
          overrides=None) -> int:
    from ..verbs.serve import start as run
    inv = _inventory(inventory, overrides)
    con = console()
    return _print_launch(run(inv, rank_order, timeout, con), con, "start")


@entry
def stop(inventory: str | None = None, overrides=None) -> int:
    from ..verbs.serve import stop as run
    inv = _inventory(inventory, overrides)
    con = console()
    res = run(inv)
    for r in res:
        ok = r.status in ("exited", "missing") and r.gpu_free
        con.print(f"{r.host} ({r.service}): {r.detail}", style="green" if ok else "bold red")
    return 0 if all(r.status in ("exited", "missing") and r.gpu_free for r in res) else 1


@entry
def status(inventory: str | None = None, json_out: bool = False, overrides=None) -> int:
    from rich.table import Table
    from ..verbs.serve import status as run
    inv = _inventory(inventory, overrides)
    rows = run(inv)
    report = status_report(rows)
    if json_out:
        return report.print_json()
    t = Table(title="status", title_justify="left")
    for c in ("rank", "host", "service", "container", "state", "uptime", "image", "GPU memory"):
        t.add_column(c, overflow="fold")
    for r in rows:
        mem = r.get("gpu_memory")
        t.add_row("-" if r["rank"] is None else str(r["rank"]), r["host"], r["service"], r.get("container", ""),
                  r["state"] + ("" if r.get("config_current", True) or not r.get("running") else
                                " (another configuration: launch --recreate)"),
                  f"{r['uptime_s']:.0f} s" if r.get("uptime_s") is not None else "-",
                  ("pinned digest" if r.get("pinned_digest_ok") else "NOT the pinned digest") if r.get("image_id") else "-",
                  f"{mem['used_mib']} / {mem['total_mib']} MiB" if mem else "-")
    con = console()
    con.print(t)
    bad = [f"{c.host}: {c.detail}" for c in report.checks if c.status == "fail"]
    con.print(Text("OK: every service runs with the current configuration" if report.ok else
                   "FAILED: " + "; ".join(bad), style="bold green" if report.ok else "bold red"))
    return report.exit_code


@entry
def logs(inventory: str | None = None, rank: str | None = None, follow: bool = False, lines: int | None = None,
         overrides=None) -> int:
    from ..verbs.serve import logs as run
    inv = _inventory(inventory, overrides)
    return run(inv, rank, follow, lines, lambda text: (sys.stdout.write(text), sys.stdout.flush()))


@entry
def launch_script(inventory: str | None = None, out: str | None = None, overrides=None) -> int:
    from ..errors import UsageError
    from ..verbs.serve import launch_script as run
    if not out:
        raise UsageError("--out DIR: where to write launch_server.sh")
    path = run(_inventory(inventory, overrides), out)
    console().print(f"wrote {path}: run it with PORT and MODEL_PATH set (e.g. PORT=8000 MODEL_PATH=/models/m {path})")
    return 0


@entry
def export(inventory: str | None = None, to: str | None = None, out: str | None = None,
           model_volume: str | None = None, rdma_resource: str | None = None, test_only: bool = False,
           overrides=None) -> int:
    from ..errors import UsageError
    from ..verbs.export import TARGETS
    from ..verbs.export import export as run
    from ..verbs.export import test_only as ask
    if test_only and to != "slurm":
        raise UsageError("--test-only: for --to slurm (sbatch --test-only)")
    if not to:
        raise UsageError(f"--to: one of {', '.join(TARGETS)}")
    if not out:
        raise UsageError("--out DIR: where to write the manifests or the batch script")
    paths = run(_inventory(inventory, overrides), to, out, model_volume, rdma_resource)
    how = "kubectl apply -f" if to == "lws" else "sbatch"
    console().print(f"wrote {', '.join(str(p) for p in paths)}; no host was contacted. Run: {how} {paths[0]}")
    if test_only:
        fits, said = ask(paths[0])
        print(f"{'fits' if fits else 'does not fit'}: sbatch --test-only {paths[0].name}: {said}",
              file=sys.stdout if fits else sys.stderr)
        return 0 if fits else 1
    return 0


@entry
def unlock(inventory: str | None = None, overrides=None) -> int:
    from ..verbs.serve import unlock as run
    from ..apply.lock import lock_host
    inv = _inventory(inventory, overrides)
    holder = run(inv)
    host = lock_host(inv).name
    console().print(f"{host}: removed the lock of {holder.describe()}" if holder else f"{host}: no lock was held")
    return 0


@entry
def verify_rdma(inventory: str | None = None, logs: list[str] | None = None, json_out: bool = False,
                overrides=None) -> int:
    from ..checks.nccl import passed_line
    from ..report import NO_HOST
    from ..verbs.verify import judge_files, verify_rdma as run
    if logs:
        results = judge_files(list(logs))
        report = rdma_report(results, host_of=lambda source: NO_HOST)  # files on this machine: no host
    else:
        plan, results = run(_inventory(inventory, overrides))
        if "nixl" in plan.verifiers:  # pd: KV blocks over NIXL, no NCCL across the rails
            return _nixl_verdicts(results, json_out)
        if not results:  # a one-host layout: no rail carries NCCL traffic
            msg = f"SKIP: layout {plan.layout} runs on one host; NCCL stays inside it, no rail to verify"
            report = rdma_report([], skipped=msg, skip_host=plan.hosts()[0], layout=plan.layout)
            if json_out:
                return report.print_json()
            console().print(Text(msg, style="yellow"))
            return report.exit_code
        report = rdma_report(results)
    if json_out:
        return report.print_json()
    con = console()
    con.print(verdict_table(results, "verify-rdma: NCCL transport per rank"))
    con.print(Text(passed_line(results, on_the_rail=not logs) if report.ok else
                   "FAILED: see the reasons; a socket fallback makes a multi-node model several times slower",
                   style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _nixl_verdicts(verdicts: list, json_out: bool) -> int:
    from rich.table import Table
    from ..report import nixl_report
    report = nixl_report(verdicts)
    if json_out:
        return report.print_json()
    con = console()
    t = Table(title="verify-rdma: NIXL (UCX) transport per instance", title_justify="left")
    for c in ("source", "verdict", "transport", "devices", "reasons"):
        t.add_column(c, overflow="fold")
    for v in verdicts:
        t.add_row(v.source, Text(v.verdict.upper(), style="green" if v.verdict == "pass" else "bold red"),
                  v.transport or "none seen", ", ".join(v.devices) or "-",
                  Text("\n".join(v.reasons), style="red") if v.reasons else "")
    con.print(t)
    con.print(Text("OK: KV blocks move over RDMA on the rails" if report.ok else
                   "FAILED: see the reasons; KV over TCP makes every request's TTFT pay for it",
                   style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _health_look(inv, cache_proof: int = 0):
    """One look: (plan, ranks, probes, metrics, report)."""
    from ..layouts.replicas import health as replicas
    from ..errors import UsageError
    from ..verbs.verify import health as run

    def probes_for(plan):
        if "replicas" in plan.verifiers:
            return replicas.api_probes(cache_proof)
        if "pd_path" in plan.verifiers and not cache_proof:
            from ..layouts.pd import health as disagg
            return disagg.api_probes(int(plan.service(plan.endpoint.service).expects("proof_words", "64")))
        if cache_proof:
            raise UsageError(f"--cache-proof: layout {plan.layout} has no shared cache (serve_layout replicas has)")
        return None

    plan, ranks, probes, metrics = run(inv, probes_for)
    return plan, ranks, probes, metrics, health_report(ranks, probes, metrics, plan.endpoint.host)


def _health_once(inv, json_out: bool, indent: int | None = 2, cache_proof: int = 0) -> int:
    plan, ranks, probes, metrics, report = _health_look(inv, cache_proof)
    if json_out:
        return report.print_json(indent)
    return _health_view(plan, ranks, probes, metrics, report)


def _health_view(plan, ranks, probes, metrics, report) -> int:
    ok = report.ok
    con = console()
    t = Table(title="health: ranks", title_justify="left")
    for c in ("rank", "host", "service", "container", "uptime", "GPU memory", "serving process", "problems"):
        t.add_column(c, overflow="fold")
    for r in ranks:
        t.add_row("-" if r.rank is None else str(r.rank), r.host, r.service, r.state, f"{r.uptime_s:.0f} s" if r.uptime_s is not None else "-",
                  f"{r.gpu_used_mib} MiB" if r.gpu_used_mib is not None else "-", r.serving_process or "-",
                  Text("; ".join(r.reasons), style="bold red") if r.reasons else Text("ok", style="green"))
    con.print(t)
    p = Table(title=f"health: API on {plan.endpoint.host} ({plan.endpoint.service})", title_justify="left")
    for c in ("probe", "result", "detail", "latency"):
        p.add_column(c, overflow="fold")
    for pr in probes:
        p.add_row(pr.name, Text("OK" if pr.ok else "FAIL", style="green" if pr.ok else "bold red"), pr.detail,
                  f"{pr.ms:.0f} ms" if pr.ms else "-")
    con.print(p)
    if metrics and "running" in metrics:
        fmt = lambda v, pct=False: "-" if v is None else (f"{v * 100:.1f} %" if pct else f"{v:g}")
        con.print(f"metrics: running {fmt(metrics['running'])}, waiting {fmt(metrics['waiting'])}, KV cache "
                  f"{fmt(metrics['kv_cache_usage'], True)}, prefix-cache hit rate "
                  f"{fmt(metrics['prefix_cache_hit_rate'], True)}, speculative acceptance "
                  f"{fmt(metrics['spec_acceptance'], True)}")
    kv = metrics.get("kv_per_rank")
    if kv and kv["per_rank"]:
        con.print("KV tokens per DP rank: " + ", ".join(f"{r}: {n:,}" for r, n in kv["per_rank"].items()) +
                  f" (min {kv['min']:,}, sum {kv['sum']:,}, spread {kv['spread'] * 100:.1f} %)")
    con.print(Text("OK: healthy" if ok else "FAILED: see above", style="bold green" if ok else "bold red"))
    return report.exit_code


@entry
def health(inventory: str | None = None, json_out: bool = False, watch: float | None = None, overrides=None,
           cache_proof: int = 0) -> int:
    import time as _time
    inv = _inventory(inventory, overrides)
    if not watch:
        return _health_once(inv, json_out, cache_proof=cache_proof)
    if watch < 1:
        from ..errors import UsageError
        raise UsageError(f"--watch {watch}: at least 1 second")
    seen: dict | None = None
    while True:  # a look every WATCH seconds until Ctrl-C (exit 130); only what changed is printed
        plan, ranks, probes, metrics, report = _health_look(inv)
        now = {(c.host, c.check): c for c in report.checks}
        if seen is None and json_out:
            report.print_json(None)
        elif seen is None:
            _health_view(plan, ranks, probes, metrics, report)
        elif {k: c.status for k, c in now.items()} != {k: c.status for k, c in seen.items()}:
            if json_out:  # one document per change, one line each (for a pager)
                report.print_json(None)
            else:
                stamp = _time.strftime("%H:%M:%S")
                for k in sorted(set(now) | set(seen)):
                    was, got = seen.get(k), now.get(k)
                    if was is None or got is None or was.status != got.status:
                        c = got or was
                        assert c is not None  # k is in now or in seen
                        console().print(f"{stamp} {c.host} {c.check}: {was.status if was else '-'} -> "
                                        f"{got.status if got else 'gone'}: {c.detail}", soft_wrap=True, markup=False)
        seen = now
        _time.sleep(watch)


@entry
def nccl_check(inventory: str | None = None, sizes: str | None = None, timeout: float | None = None,
               json_out: bool = False, overrides=None) -> int:
    from rich.table import Table
    from ..verbs.nccl_check import nccl_check as run, parse_sizes
    inv = _inventory(inventory, overrides)
    if sizes:
        parse_sizes(sizes)
    rep = run(inv, sizes, timeout, None if json_out else console(stderr=True))
    report = nccl_report(rep)
    if json_out:
        return report.print_json()
    con = console()
    if hasattr(rep, "local_ranks"):
        return _nccl_one_host_out(con, rep, report)
    con.print(verdict_table(rep.ranks, "nccl-check: transport per rank"))
    b = Table(title="all-reduce (slowest rank per size)", title_justify="left")
    for c in ("size", "time", "algbw", "busbw", "of the link"):
        b.add_column(c, justify="right")
    for s in rep.sizes:
        b.add_row(_size(s.bytes), f"{s.time_ms:.2f} ms", f"{s.algbw_gbs:.2f} GB/s", f"{s.busbw_gbs:.2f} GB/s",
                  f"{s.busbw_gbs * 8000 / rep.link_speed_mbps * 100:.0f} %")
    con.print(b)
    for e in rep.errors:
        con.print(Text(f"error: {e}", style="bold red"))
    frac = "-" if rep.link_fraction is None else f"{rep.link_fraction * 100:.0f} %"
    con.print(Text(f"{'OK' if report.ok else 'FAILED'}: largest size reached {frac} of {rep.link_speed_mbps} Mb/s "
                   f"(threshold {rep.threshold * 100:.0f} %); probe containers removed on "
                   f"{', '.join(rep.removed) or 'none'}", style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _nccl_one_host_out(con, rep, report) -> int:
    from rich.table import Table
    from ..report import checks_table
    con.print(checks_table(report.checks, f"nccl-check: {rep.local_ranks} GPUs of {rep.host} ({rep.layout})"))
    b = Table(title=f"all-reduce across {rep.local_ranks} GPUs (slowest rank per size)", title_justify="left")
    for c in ("size", "time", "algbw", "busbw"):
        b.add_column(c, justify="right")
    for s in rep.sizes:
        b.add_row(_size(s.bytes), f"{s.time_ms:.3f} ms", f"{s.algbw_gbs:.2f} GB/s", f"{s.busbw_gbs:.2f} GB/s")
    con.print(b)
    busbw = f"{rep.sizes[-1].busbw_gbs:.1f} GB/s" if rep.sizes else "-"
    t = rep.transport
    how = " + ".join(x for x in ((t.transport if t else None), ("NVLS" if t and t.nvls else None)) if x) or \
        "no transport seen"
    con.print(Text(f"{'OK' if report.ok else 'FAILED'}: {how}, largest size's bus bandwidth {busbw} "
                   f"(threshold {rep.min_busbw_gbs:g} GB/s); probe container removed on "
                   f"{', '.join(rep.removed) or 'none'}", style="bold green" if report.ok else "bold red"))
    return report.exit_code


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- lab

@entry
def lab_up(hosts: int | None = None, shape: str | None = None, gpu: str = "H200", slurm: bool = False,
           engine: str | None = None, layout: str | None = None) -> int:
    import railyard_lab as lab
    path = lab.up(hosts, log=lambda m: print(m, file=sys.stderr), shape=shape, gpu=gpu, slurm=slurm, engine=engine,
                  layout=layout)
    print(path)
    return 0


@entry
def lab_down() -> int:
    import railyard_lab as lab
    lab.down(log=lambda m: print(m, file=sys.stderr))
    return 0


@entry
def lab_fault(host: str, kind: str, value: str | None = None) -> int:
    from railyard_lab import faults
    print(faults.fault(host, kind, value))
    return 0


@entry
def lab_heal(host: str | None = None) -> int:
    from railyard_lab import faults
    done = faults.heal(host)
    print("\n".join(done) if done else "nothing to heal")
    return 0


@entry
def lab_checkpoint(size_gb: float = 0.5, shards: int = 10, host: str | None = None) -> int:
    import railyard_lab as lab
    from railyard_lab.checkpoint import write_checkpoint
    from ..errors import UsageError
    if size_gb <= 0 or not 1 <= shards <= 100_000:
        raise UsageError(f"--size-gb {size_gb} --shards {shards}: size must be > 0 and shards 1..100000")
    root = lab.lab_dir()
    h = lab.lab_host(root, host or lab.hosts_of(root)[0].name)
    layout = lab.lab_layout(root)
    where = lab.lab_model_path(layout)  # ~/models/..., the lab inventory's model_path
    out = write_checkpoint(h.home / where.removeprefix("~/"), size_gb, shards, kind=lab.model_kind(layout))
    print(f"{h.name}: wrote {out['files']} files, {out['bytes'] / 1e9:.2f} GB of shards, at {where}")
    return 0


@entry
def lab_ssh(host: str, command: list[str] | None = None) -> int:
    import railyard_lab as lab
    root = lab.lab_dir()
    h = lab.lab_host(root, host)
    argv = lab.ssh_argv(root, h, command)
    if command:
        return subprocess.run(argv).returncode
    if sys.stdin.isatty():
        argv.insert(1, "-t")
    os.execvp(argv[0], argv)
    return 0


def remainder(argv: list[str] | None = None) -> list[str]:
    """The words after `--` on the command line (invoke keeps them away from tasks)."""
    argv = sys.argv if argv is None else argv
    return argv[argv.index("--") + 1:] if "--" in argv else []


# ---------------------------------------------------------------- plan

@entry
def plan(inventory: str | None = None, model: str | None = None, gpu_memory_gib: float | None = None,
         gpus: int | None = None, context: int | None = None, json_out: bool = False,
         gpu_memory_utilization: float | None = None, kv_cache_dtype: str | None = None,
         reserve_gib: float | None = None, block_size: int | None = None, mtp: bool = False,
         dp_reserve_gib: float | None = None, overrides=None, against_engine: bool = False) -> int:
    from ..verbs.capacity import Assumptions, gather, parse_checkpoint, plan_capacity, plan_json
    from .plan_view import print_plan
    a = Assumptions(mtp=mtp, context=context, block_size=block_size, dp_reserve_gib=dp_reserve_gib)
    if gpu_memory_utilization is not None:
        a.gpu_memory_utilization = gpu_memory_utilization
    if kv_cache_dtype is not None:
        a.kv_cache_dtype = kv_cache_dtype
    if reserve_gib is not None:
        a.reserve_gib = reserve_gib
    if against_engine:
        if gpus is not None or context is not None:
            from ..errors import UsageError
            raise UsageError("--against-engine: the engines' own parallel sizes and lengths are used; leave out "
                             "--gpus and --context")
        return _plan_against_engine(_inventory(inventory, overrides), model, gpu_memory_gib, a, json_out)
    doc, found = gather(lambda: _inventory(inventory, overrides), model, gpu_memory_gib, gpus)
    result = plan_capacity(parse_checkpoint(doc), found, a)
    report = plan_report(plan_json(result))
    if json_out:
        return report.print_json()
    print_plan(result, console())
    return report.exit_code


def _plan_against_engine(inv, model: str | None, gpu_memory_gib: float | None, a, json_out: bool) -> int:
    """The running deployment's engines: railyard's KV tokens beside what each printed."""
    from ..verbs import capacity as C
    from ..verbs.against import TOLERANCE_PCT, compare, engine_services
    from ..verbs.serve import build_plan
    from ..report import engine_kv_report, engine_kv_table
    from ..transport.runner import Runner
    from ..plan import layout as layouts
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        from ..errors import UsageError
        raise UsageError(f"--gpu-memory-gib {gpu_memory_gib}: must be positive")
    with Runner(layouts.get(inv).hosts(inv)) as runner:
        plan = build_plan(inv, runner, strict=False)
        engines = engine_services(plan)
        host = inv.host(engines[0].host) if engines else inv.head
        doc = C.read_local(model) if model is not None else C.read_remote(runner.session(host), host.vars["model_path"])
        ckpt = C.parse_checkpoint(doc)
        rows = compare(plan, runner, ckpt, a, gpu_memory_gib, lambda h: inv.host(h).vars["cluster_gpu_name"])
    spec = C.model_spec(ckpt.config, f"{ckpt.dir}/config.json")
    assumptions = {"model_dir": ckpt.dir, "reserve_gib_per_gpu": a.reserve_gib,
                   "dp_reserve_gib_per_gpu": a.reserve_gib if a.dp_reserve_gib is None else a.dp_reserve_gib,
                   "gpu_memory_utilization_default": a.gpu_memory_utilization, "mtp": a.mtp,
                   "tolerance_pct": TOLERANCE_PCT, "layout": plan.layout, "deployment": plan.deployment,
                   "difference": "(planned - engine) / engine x 100"}
    report = engine_kv_report(rows, spec.architecture, assumptions, TOLERANCE_PCT)
    if json_out:
        return report.print_json()
    con = console()
    con.print(engine_kv_table(rows))
    for r in rows:
        for n in r.notes:
            con.print(f"  {r.service} DP{r.dp_rank}: {n}", style="yellow", markup=False)
    con.print(f"model: {ckpt.dir} ({spec.architecture}); difference = (planned - engine) / engine; GPU engines: "
              f"memory x --gpu-memory-utilization - weights - reserve {a.reserve_gib:g} GiB (--reserve-gib); CPU "
              "build: VLLM_CPU_KVCACHE_SPACE GiB per worker, block 128", markup=False, highlight=False)
    far = [c for c in report.checks if c.status != "pass"]
    con.print(Text(f"OK: every engine within {TOLERANCE_PCT:g} % of the plan" if not far else
                   f"{len(far)} engine(s) not within {TOLERANCE_PCT:g} % or not seen: see above",
                   style="bold green" if not far else "yellow"))
    return report.exit_code


@entry
def render(inventory: str | None = None, compose: str | None = None, overrides=None) -> int:
    from ..errors import UsageError
    from ..verbs.serve import render_compose
    if not compose:
        raise UsageError("--compose DIR: where to write docker-compose.yml")
    paths = render_compose(_inventory(inventory, overrides), compose)
    console().print(f"wrote {', '.join(str(p) for p in paths)}; run `docker compose up -d` in {compose} on the host")
    return 0


@entry
def recover(inventory: str | None = None, replica: str | None = None, dry_run: bool = False,
            timeout: float | None = None, drain_timeout: float = 300.0, json_out: bool = False, overrides=None) -> int:
    from ..verbs.serve import recover as run
    con = console()
    plan, rec = run(_inventory(inventory, overrides), replica, dry_run, timeout, drain_timeout,
                    None if json_out else con)
    if json_out:
        return recover_report(plan, rec, dry_run).print_json()
    title = {"none": "nothing to recover", "short": "short path: restart the replica alone",
             "long": "long path: restart LMCache and every replica", "blocked": "blocked"}[rec.path]
    con.print(Text(f"recover ({plan.deployment}): {title}", style="bold"))
    for w in rec.why:
        con.print(f"  why: {w}")
    if dry_run or rec.path in ("none", "blocked"):
        for i, st in enumerate(rec.steps, 1):
            con.print(f"  {'would' if dry_run and rec.path != 'blocked' else 'do'} {i}. {st}")
    for d in rec.done:
        con.print(Text(f"  done: {d}", style="green"))
    if rec.failure:
        con.print(Text(f"FAILED: {rec.failure}", style="bold red"))
    elif rec.path == "blocked":
        con.print(Text("FAILED: recover does not touch a process it did not start", style="bold red"))
    elif not dry_run and rec.path != "none":
        con.print(Text(f"OK: {', '.join(rec.replicas)} recovered", style="bold green"))
    return 0 if rec.ok else 1


@entry
def collect(inventory: str | None = None, out: str | None = None, preflight: bool = True, overrides=None) -> int:
    import time as _time
    from pathlib import Path as _Path

    from ..verbs.collect import collect as run
    from ..verbs.serve import build_plan
    from ..verbs.preflight import run_preflight
    from ..report import preflight_report
    from ..transport.runner import Runner
    from ..plan import layout as layouts
    inv = _inventory(inventory, overrides)
    con = console(stderr=True)
    try:  # the plan names the services whose containers, logs and env files are collected
        with Runner(layouts.get(inv).hosts(inv)) as runner:
            plan = build_plan(inv, runner, strict=False)
    except RailyardError as e:
        con.print(f"collect: no plan ({e}); collecting the hosts only", style="yellow")
        plan = None
    doc = preflight_report(run_preflight(inv)).json() if preflight else None
    path = _Path(out or f"railyard-collect-{plan.deployment if plan else 'hosts'}-"
                        f"{_time.strftime('%Y%m%d-%H%M%S')}.tar.gz")
    manifest = run(inv, plan, path, doc)
    failed = {h: v["error"] for h, v in manifest["hosts"].items() if "error" in v}
    size = path.stat().st_size
    console().print(f"wrote {path} ({size / 1024:.0f} KiB, {len(manifest['files'])} files from "
                    f"{len(manifest['hosts']) - len(failed)} of {len(manifest['hosts'])} hosts in "
                    f"{manifest['seconds']:g} s)" + "".join(f"\n  {h}: {e}" for h, e in failed.items()))
    return 1 if failed else 0


@entry
def bench(inventory: str | None = None, concurrency: str | None = None, isl: int | None = None, osl: int | None = None,
          isl_stddev: int = 0, osl_stddev: int = 0, dataset: str | None = None, prefix_prompts: int = 0,
          prefix_length: int = 0, warmup: int = 3, requests: int = 10, seed: int = 1, slo=None, require: bool = False,
          sweep: str | None = None, compare: str | None = None, out: str | None = None, tokenizer: str | None = None,
          timeout: float | None = None, json_out: bool = False, overrides=None, where: str | None = None) -> int:
    from pathlib import Path
    from . import bench_view as view
    from ..bench.aiperf import Load, check_usage
    from ..bench.run import Options, bench as run, load_compare, parse_concurrency, parse_sweep
    from ..bench.slo import parse_slos
    from ..errors import UsageError
    inv = _inventory(inventory, overrides)
    slos = parse_slos(slo or [])
    if not slos:  # a deployment's own SLOs from its variables (bench_slos), when the command line gives none
        slos = parse_slos(inv.head.vars.get("bench_slos") or [], "bench_slos")
    if dataset and (isl or prefix_prompts):
        raise UsageError("--dataset FILE takes its prompts from the file: leave out --isl and --prefix-prompts")
    load = Load(isl=128 if isl is None else isl, osl=64 if osl is None else osl, isl_stddev=isl_stddev, osl_stddev=osl_stddev, dataset=dataset,
                prefix_prompts=prefix_prompts, prefix_length=prefix_length, warmup_per_c=warmup,
                requests_per_c=requests, seed=seed)
    check_usage(load)
    where = where or inv.head.vars.get("bench_where") or "control"
    if where not in ("control", "head"):
        raise UsageError(f"--where {where!r}: control (this machine) or head (the endpoint's host)")
    if tokenizer and not Path(tokenizer).is_dir() and where == "control":
        raise UsageError(f"--tokenizer {tokenizer}: no such directory")
    swept = parse_sweep(sweep, inv) if sweep else None
    if swept:  # every value checked as `inv launch` would, before the first relaunch (exit 2, no host touched)
        from ..plan import layout as layouts
        for v in swept[1]:
            try:
                layouts.validated(_inventory(inventory, list(overrides or []) + [f"{swept[0]}={v}"]))
            except InventoryError as e:
                raise UsageError(f"--sweep {sweep}: {swept[0]}={v}: " + "; ".join(
                    p.message for p in e.problems))
    opts = Options(concurrency=parse_concurrency(concurrency or "1,8,16,32"), load=load, slos=slos,
                   sweep=swept, compare=load_compare(compare) if compare else None,
                   out=Path(out or "bench"), tokenizer=tokenizer, start_timeout=timeout, where=where)
    err = console(stderr=True)
    summary = run(inv, opts, overrides, err if not json_out else None, log=lambda m: err.print(m, style="dim",
                                                                                               highlight=False))
    rep = view.report(summary, require)
    if json_out:
        return rep.print_json()
    con = console()
    for t in view.tables(summary):
        con.print(t)
    for line in view.verdict_lines(summary):
        con.print(line)
    con.print(Text(f"results: {summary['dir']} (summary.json, {', '.join(summary['plots'])}, AIPerf's exports per "
                   "c<C>/)", style="dim"), highlight=False)
    if summary.get("restored") is False:
        con.print(Text("FAILED: the original configuration is not back: inv launch --recreate", style="bold red"))
    return rep.exit_code
