#!/usr/bin/env python3
"""Fan-out speed: `inv preflight` against plain ssh and Ansible making the same probes, on 2, 8 and 24 lab hosts.

For each N the lab is resized to N hosts, then, in turn, R times each:
  - railyard: `inv preflight --json` as a user runs it (process start and imports included);
  - plain ssh: the very same probe script per host (railyard's, from preflight.sections_for), one OpenSSH
    `ssh` per host, all in parallel, output only collected: the floor for this host work;
  - Ansible, two ways (ansible-core pinned, its own venv made on first use; gather_facts off, forks = N, its
    ssh defaults, ControlPersist on): a playbook with one shell task per probe (a loop: how a playbook reads
    best), and the one a practitioner writes for speed, one shell task running the same probe script as
    plain ssh.
It prints the median wall time of each, the ratios, and the controller's CPU per host (user + sys of the
controller process and its children: inv, the ssh clients, ansible-playbook and its workers), and the
machine's busy CPU meanwhile (the controller and every lab host: /proc/stat).

    sudo python3 benchmarks/fanout.py [--sizes 2,8,24] [--repeat 3] [--no-ansible]

Needs root (the lab). The machine's cores are shared by the controller and every host. Leaves a 2-host lab.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import railyard_lab as lab  # noqa: E402
import railyard.layouts  # noqa: E402,F401  (every layout registers before an inventory is loaded)
from railyard.inventory import load_inventory  # noqa: E402
from railyard_lab import components  # noqa: E402
from railyard.verbs.preflight import sections_for  # noqa: E402
from railyard.facts.probe import joined_script, new_token, section_body  # noqa: E402


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: user, nice, system, irq, softirq, steal): the
    controller and every lab host together."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def timed(argv: list[str] | list[list[str]], env: dict | None = None) -> tuple[float, float, float, bool]:
    """Run one command (or several at once) to the end: wall seconds, CPU seconds of it and its children, the
    machine's busy CPU seconds meanwhile, and whether all exited 0."""
    many = argv if argv and isinstance(argv[0], list) else [argv]
    cpu0, all0, t = children_cpu(), machine_cpu(), time.perf_counter()
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env) for a in many]
    outs = [p.communicate()[0] for p in procs]
    took = (time.perf_counter() - t, children_cpu() - cpu0, machine_cpu() - all0)
    if many[0][:4] == [sys.executable, "-m", "invoke", "preflight"] and procs[0].returncode:
        for c in json.loads(outs[0])["checks"]:  # say what failed: a benchmark of a failing run is no benchmark
            if c["status"] == "fail":
                print(f"       railyard run failed: {c['host']} {c['check']}: {c['detail'][:160]}", flush=True)
    return (*took, all(p.returncode == 0 for p in procs))


def railyard(inv_path: Path) -> tuple[float, float, float, bool]:
    return timed([sys.executable, "-m", "invoke", "preflight", "--json", "-i", str(inv_path)])


def ssh_opts(root: Path) -> list[str]:
    return ["-i", str(root / "id_ed25519"), "-o", f"UserKnownHostsFile={root / 'known_hosts'}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]


def plain_ssh(inv_path: Path) -> tuple[float, float, float, bool]:
    inv = load_inventory(inv_path)
    root = lab.lab_dir()
    return timed([["ssh", *ssh_opts(root), f"root@{h.address}",
                   "date +%s.%N; hostname\n" + joined_script(sections_for(h, inv), new_token())] for h in inv.hosts])


def ansible_project(inv_path: Path, where: Path) -> Path:
    """An inventory with each host's probes as host vars (!unsafe: never templated), a playbook running them one
    task each (probes.yml), and one running the joined probe script in one task (one.yml)."""
    inv = load_inventory(inv_path)
    root = lab.lab_dir()
    (where / "host_vars").mkdir(parents=True, exist_ok=True)
    lines = ["[lab]"]
    for h in inv.hosts:
        lines.append(f"{h.name} ansible_host={h.address} ansible_user=root ansible_python_interpreter=/usr/bin/python3"
                     f" ansible_ssh_private_key_file={root / 'id_ed25519'}"
                     f" ansible_ssh_common_args='-o UserKnownHostsFile={root / 'known_hosts'}"
                     " -o StrictHostKeyChecking=yes'")
        probes = [{"key": "clock", "cmd": "date +%s.%N; hostname", "timeout": 10}]
        probes += [{"key": s.key, "cmd": section_body(s), "timeout": s.timeout} for s in sections_for(h, inv)]
        text = "probes:\n" + "".join(f"  - key: {p['key']}\n    timeout: {p['timeout']}\n"
                                     f"    cmd: !unsafe {json.dumps(p['cmd'])}\n" for p in probes)
        text += "script: !unsafe " + json.dumps("date +%s.%N; hostname\n" + joined_script(sections_for(h, inv),
                                                                                         new_token())) + "\n"
        (where / "host_vars" / f"{h.name}.yml").write_text(text)
    (where / "hosts.ini").write_text("\n".join(lines) + "\n")
    (where / "probes.yml").write_text(
        "- hosts: lab\n  gather_facts: false\n  tasks:\n"
        "    - name: probe\n"
        "      ansible.builtin.shell: \"timeout -k 2 {{ item.timeout }} sh -c {{ item.cmd | quote }}\"\n"
        "      loop: \"{{ probes }}\"\n      loop_control: {label: \"{{ item.key }}\"}\n"
        "      changed_when: false\n      failed_when: false\n")
    (where / "one.yml").write_text(
        "- hosts: lab\n  gather_facts: false\n  tasks:\n"
        "    - name: probes\n      ansible.builtin.shell: \"{{ script }}\"\n"
        "      changed_when: false\n      failed_when: false\n")
    return where


def ansible(project: Path, n: int, playbook: str) -> tuple[float, float, float, bool]:
    env = {**os.environ, "ANSIBLE_FORKS": str(n), "ANSIBLE_HOST_KEY_CHECKING": "True",
           "ANSIBLE_LOCAL_TEMP": str(project / "tmp")}
    program = components.program("ansible")
    return timed([str(program), "-i", str(project / "hosts.ini"), str(project / playbook)], env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,8,24")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-ansible", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.no_ansible:
        components.ensure("ansible")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="railyard-fanout-"))
    for n in sizes:
        inv_path = lab.up(n, log=lambda *_: None)
        railyard(inv_path)  # warm: ARP tables, page cache
        runs: dict[str, list[tuple[float, float, float, bool]]] = {"railyard": [], "ssh": [], "ansible": [],
                                                                   "ansible_one": []}
        project = None if args.no_ansible else ansible_project(inv_path, work / f"n{n}")
        for _ in range(args.repeat):
            runs["railyard"].append(railyard(inv_path))
            runs["ssh"].append(plain_ssh(inv_path))
            if project:
                runs["ansible"].append(ansible(project, n, "probes.yml"))
                runs["ansible_one"].append(ansible(project, n, "one.yml"))
        med = {k: (*(statistics.median(r[i] for r in v) for i in range(3)), all(r[3] for r in v))
               for k, v in runs.items() if v}
        rows.append((n, med))
        ours, floor = med["railyard"], med["ssh"]
        line = (f"N={n:>3}  railyard {ours[0]:6.2f} s  plain ssh {floor[0]:6.2f} s  ratio {ours[0] / floor[0]:4.2f}")
        if "ansible" in med:
            line += (f"   Ansible, a task per probe {med['ansible'][0]:6.2f} s ({med['ansible'][0] / ours[0]:4.1f}x),"
                     f" one task {med['ansible_one'][0]:6.2f} s ({med['ansible_one'][0] / ours[0]:4.1f}x)")
        cpu = "  ".join(f"{k} {v[1] / n * 1000:5.0f} ms" for k, v in med.items())
        busy = "  ".join(f"{k} {v[2]:5.1f} s" for k, v in med.items())
        print(line, flush=True)
        ran = ", ".join(f"{k} {'ok' if v[3] else 'FAILED'}" for k, v in med.items())
        print(f"       controller CPU per host: {cpu}   (median of {args.repeat}; {ran})", flush=True)
        print(f"       machine CPU (controller and hosts): {busy}", flush=True)
    lab.up(2, log=lambda *_: None)
    shutil.rmtree(work, ignore_errors=True)
    print()
    print("N, railyard_s, plain_ssh_s, ansible_task_per_probe_s, ansible_one_task_s, railyard/ssh, "
          "ansible_per_probe/railyard, ansible_one/railyard, cpu_ms_per_host_railyard, cpu_ms_per_host_ssh, "
          "cpu_ms_per_host_ansible_per_probe, cpu_ms_per_host_ansible_one, machine_cpu_s_railyard")
    nan = (float("nan"),) * 4
    for n, med in rows:
        r, f, a, o = med["railyard"], med["ssh"], med.get("ansible", nan), med.get("ansible_one", nan)
        print(f"{n}, {r[0]:.3f}, {f[0]:.3f}, {a[0]:.3f}, {o[0]:.3f}, {r[0] / f[0]:.2f}, {a[0] / r[0]:.1f}, "
              f"{o[0] / r[0]:.1f}, {r[1] / n * 1000:.0f}, {f[1] / n * 1000:.0f}, {a[1] / n * 1000:.0f}, "
              f"{o[1] / n * 1000:.0f}, {r[2]:.1f}")
    print("rerun: sudo python3 " + shlex.join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
