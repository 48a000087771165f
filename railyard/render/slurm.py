"""A plan as one Slurm batch script: `sbatch` runs the deployment on the nodes Slurm allocates.

    text = render(plan, inv)

One node per host of the plan (`--nodes`, one task per node, `--exclusive`, `--gpus-per-node`),
the head on node 0: the first host of `$SLURM_JOB_NODELIST`, where the batch script runs. The
stages start in the plan's order (workers first), each service as its own job step that runs
`inv launch`'s `docker run` and holds the container, removing it when the step ends (scancel, a
failed gate, the job's time limit). Every gate of the plan runs on the service's node, a stage's
gates at once: running for its seconds, its log line, a KV line from every engine core, its HTTP
paths; the head's readiness is the script's last gate.

What the plan leaves symbolic is found on the node when its step starts, as `inv env` finds it
over SSH: the rank is the node's place in `$SLURM_JOB_NODELIST` (the job-wide `$SLURM_NODEID`; a step on
one node has 0 there), the group size `$SLURM_JOB_NUM_NODES`, the head address the rail
address of the group head's node, the node's own rail address (`ip -4 addr show dev RAIL`), its
RoCE v2 GID index (`show_gids HCA`), its GPUs (the first whose name holds `cluster_gpu_name`, as
railyard picks them) and `$HOME`. A secret is read from its file on the node, never put in argv.
"""

from __future__ import annotations

from ..errors import UsageError
from ..inventory import Inventory
from ..plan.spec import LaunchPlan, Service
from ..facts.net import ib_hca_device
from ..transport import q
from . import walk
from .docker import run_argv

def _shell(text: str, variables: dict[str, str]) -> str:
    """Shell text whose tokens (always inside shlex's single quotes) become their variables."""
    def by(name: str) -> str:
        if name in variables:
            v = variables[name]
        elif name == "home":
            v = "$HOME"
        elif name.startswith("gpu") and name[3:].isdigit():
            v = f"$GPU{name[3:]}"
        else:
            raise UsageError(f"--to slurm: {name} has no value on a Slurm node")
        return v if v.isdigit() else "'\"" + v + "\"'"
    return walk.replace_tokens(text, by)


def docker_line(plan: LaunchPlan, svc: Service, variables: dict[str, str]) -> str:
    """inv launch's `docker run` of the service (no hash label: its node's values are known only there)."""
    argv = [walk.own_address(a, svc) for a in run_argv(plan, svc, with_hash=False, resolved=walk.markers(svc))]
    return _shell(" ".join(q(a) for a in argv), variables)


def _new_secret(s) -> str:
    """As inv launch does on the first launch: a random value in a 0600 file, when the file is missing."""
    f = _shell(q(s.host_file), {})
    prefix = q(s.prefix) if s.prefix else "''"
    value = '"$(head -c 32 /dev/urandom | base64 | tr -d \'/+=\\n\')"'
    return (f'[ -s {f} ] || (umask 077; mkdir -p "$(dirname {f})"; '
            f"printf '%s%s\\n' {prefix} {value} > {f})")


def _gates(svc: Service) -> list[str]:
    name = q(svc.spec.name)
    addr = "$NODE_ADDR" if svc.address and svc.spec.bind == svc.address else walk.local_address(svc.spec.bind)
    out = [f"wait_running {name} {svc.started.seconds:g}"]
    for g in svc.ready:
        if g.kind == "log":
            out.append(f"wait_log {name} {q(g.pattern)}")
        elif g.kind == "kv_engines":
            out.append(f"wait_kv {name} {g.count}")
        elif g.kind == "http":
            out.append(f'wait_http {name} "http://{addr}:{g.port or svc.spec.ports[0]}"{q(g.path)}')
    return out


MEMBER = r'''set -euo pipefail
action=$1 service=$2
export HEAD_ADDR=${3:-}  # the group head's rail address, for the ranks that join it
me="${SLURMD_NODENAME:-$(hostname -s)}"
node_rank() {  # NODE_RANK: this node's place in $SLURM_JOB_NODELIST (a step on one node has SLURM_NODEID 0)
    local nodes i
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    NODE_RANK=-1
    for i in "${!nodes[@]}"; do [ "${nodes[$i]}" != "$me" ] || NODE_RANK=$i; done
    [ "$NODE_RANK" -ge 0 ] || die "$me is not in the job's nodes (${nodes[*]})"
}
die() { echo "railyard: $me: $*" >&2; exit 1; }
rail() {  # the node's own address on the rail and the RoCE v2 GID index holding it, as inv env finds them
    NODE_ADDR=$(ip -4 -o addr show dev "$1" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    [ -n "$NODE_ADDR" ] || die "no IPv4 address on $1 (fix: the rail's address; inv preflight's rail_ip)"
    if [ -n "$2" ]; then
        GID_INDEX=$(show_gids "$2" 2>/dev/null | awk -v ip="$NODE_ADDR" '$5 == ip && $6 == "v2" {print $3; exit}')
        [ -n "$GID_INDEX" ] || die "no RoCE v2 GID for $NODE_ADDR on $2 (fix: RoCE v2 enabled; show_gids $2)"
    fi
}
gpus() {  # GPU0, GPU1, ...: the first $2 GPUs whose name holds $1
    local i=0 uuid name
    while IFS=, read -r uuid name; do
        case "$name" in *"$1"*) printf -v "GPU$i" %s "$uuid"; i=$((i + 1));; esac
    done < <(nvidia-smi --query-gpu=uuid,name --format=csv,noheader)
    [ "$i" -ge "$2" ] || die "$i GPU(s) match '$1', the layout needs $2 (fix: cluster_gpu_name; nvidia-smi -L)"
}
deadline=$((SECONDS + ${RAILYARD_START_TIMEOUT:-1800}))
running() { [ "$(docker inspect -f '{{.State.Running}}' "$1" 2>/dev/null)" = true ]; }
gave_up() { docker logs --tail 30 "$1" 2>&1 | sed "s/^/  $1: /" >&2; die "$1: $2"; }
until_ok() {  # NAME WHAT CMD...: retry CMD until it passes, the container stops or the deadline passes
    local n=$1 what=$2; shift 2
    until "$@"; do
        running "$n" || gave_up "$n" "exited before $what"
        [ "$SECONDS" -lt "$deadline" ] || gave_up "$n" "no $what in ${RAILYARD_START_TIMEOUT:-1800} s"
        sleep 1
    done
}
started() {  # running, or not created or not started yet (its step may still be starting it); an exited one fails
    running "$1" && return 0
    case "$(docker inspect -f '{{.State.Status}}' "$1" 2>/dev/null)" in
        exited|dead) gave_up "$1" "exited before it started" ;;
    esac
    [ "$SECONDS" -lt "$deadline" ] || die "$1 was not created in ${RAILYARD_START_TIMEOUT:-1800} s"
    return 1
}
wait_running() {
    until started "$1"; do sleep 1; done
    sleep "$2"
    running "$1" || gave_up "$1" "exited within $2 s"
}
log_has() { docker logs "$1" 2>&1 | grep -qF -- "$2"; }
wait_log() { until_ok "$1" "\`$2\` in its log" log_has "$1" "$2"; }
kv_lines() {  # every engine core logged its KV cache size
    local got
    got=$(docker logs "$1" 2>&1 | grep -F 'KV cache size:' | sed -n 's/.*(\(EngineCore[_A-Z0-9]*\) .*/\1/p' | sort -u | wc -l)
    [ "$got" -ge "$2" ]
}
wait_kv() { until_ok "$1" "KV cache line from $2 engine(s)" kv_lines "$1" "$2"; }
http_ok() { [ "$(curl -sS -o /dev/null -w '%{http_code}' --max-time 5 "$1" 2>/dev/null)" = 200 ]; }
wait_http() { until_ok "$1" "200 from $2" http_ok "$2"; }
guard() {  # from before its start, the step removes the container when it ends (scancel, job end, a failure)
    # shellcheck disable=SC2064  # the name, now
    trap "docker rm -f $(printf %q "$1") >/dev/null 2>&1 || true" EXIT
    trap 'exit 143' TERM INT
}
hold() {
    while running "$1"; do sleep 2 & wait $!; done
    docker logs --tail 30 "$1" 2>&1 | sed "s/^/  $1: /" >&2
    die "$1 exited"
}
'''


def _components(plan: LaunchPlan) -> list[list[str]]:
    """The job's components, each a list of hosts: one, the head's host first (node 0, the first host of
    the node list); for prefill/decode pools a heterogeneous job, one component per pool (its own node
    count and GPUs per node), the proxy with its host's pool."""
    hosts = plan.report_hosts()
    pools = [r for r in ("prefill", "decode") if any(s.role == r for s in plan.services())]
    if len(pools) < 2:
        return [hosts]
    pool_of = {h: next((s.role for s in plan.on_host(h) if s.role in pools), "") for h in hosts}
    comps = [[h for h in hosts if pool_of[h] == p] for p in pools]
    rest = [h for h in hosts if not pool_of[h]]
    return [c for c in comps + [rest] if c]


def _gpus(plan: LaunchPlan, hosts: list[str]) -> int:
    return max(sum(s.spec.gpus.count for s in plan.on_host(h) if s.expects("gpu_process", "required") == "required")
               for h in hosts)


def render(plan: LaunchPlan, inv: Inventory) -> str:
    comps = _components(plan)
    het = len(comps) > 1
    hosts = [h for c in comps for h in c]
    node = {h: i for i, h in enumerate(hosts)}  # a place in the job; (component, index) in `at`
    at = {h: (ci, c.index(h)) for ci, c in enumerate(comps) for h in c}
    n = len(hosts)
    ep = plan.endpoint
    timeout = int(float(inv.host(ep.host).vars.get("vllm_start_timeout_s", 1800)))
    cases, starts = [], []
    for svc, _ in walk.in_order(plan):
        k = node[svc.host]
        group = plan.group(svc.group) if svc.group else [svc]
        variables = {"ref_head_addr": "$HEAD_ADDR", "ref_node_addr": "$NODE_ADDR", "ref_gid_index": "$GID_INDEX",
                     "gid_index": "$GID_INDEX",
                     "ref_node_rank": "$NODE_RANK" if svc.rank == k else str(svc.rank or 0),
                     "ref_group_size": "$SLURM_JOB_NUM_NODES" if svc.group_size == n and n > 1 else str(svc.group_size)}
        line = docker_line(plan, svc, variables)
        env = dict(svc.spec.env)
        needs = walk.tokens_in(" ".join(q(walk.own_address(a, svc)) for a in run_argv(plan, svc, False, walk.markers(svc))))
        setup = []
        if needs & {"ref_node_addr", "ref_gid_index", "gid_index"} or (svc.address and svc.spec.bind == svc.address):
            iface = env.get("NCCL_SOCKET_IFNAME") or inv.host(svc.host).serve_rail.name
            hca = ib_hca_device(str(env.get("NCCL_IB_HCA", ""))) if needs & {"ref_gid_index", "gid_index"} else ""
            setup.append(f"rail {q(str(iface))} {q(str(hca))}")
        if "ref_node_rank" in needs and svc.rank == k:
            setup.append("node_rank")
        count = max([int(t[3:]) + 1 for t in needs if t.startswith("gpu") and t[3:].isdigit()] or [0])
        if count:
            setup.append(f"gpus {q(svc.spec.gpus.name or inv.host(svc.host).vars['cluster_gpu_name'])} {count}")
        name = q(svc.spec.name)
        secrets = [_new_secret(s) for s in svc.spec.secrets]
        body = setup + secrets + [f"guard {name}", f"docker rm -f {name} >/dev/null 2>&1 || true", line, f"hold {name}"]
        cases.append(f"    {svc.name}:run)\n        " + "\n        ".join(body) + " ;;")
        on_rail = [x for x in setup[:1] if svc.address and svc.spec.bind == svc.address]  # its gates ask its rail address
        cases.append(f"    {svc.name}:gate)\n        " + "\n        ".join(on_rail + _gates(svc)) + " ;;")
        head_node = node[group[0].host]
        starts.append((svc, k, head_node))
    member = (MEMBER + 'case "$service:$action" in\n' + "\n".join(cases) +
              '\n    *) die "no service $service (action $action) in this job";;\nesac\n')
    def where(h: str) -> str:
        ci, i = at[h]
        return f"${{NODES_{ci}[{i}]}}" if het else f"${{NODES[{i}]}}"

    def place(h: str) -> str:
        ci, i = at[h]
        return f"{ci} {i}" if het else str(i)
    what = "one heterogeneous Slurm job, a component per pool" if het else "one Slurm job"
    out = [
        "#!/bin/bash",
        f"# Rendered by railyard from the {plan.layout} plan of {plan.deployment}: the containers `inv launch` starts,",
        f"# as {what}. Submit: sbatch [--partition=P] [--time=T] {plan.deployment}.sbatch",
        "# Stop: scancel JOBID (each service's step removes its container). Nodes, in order: " + ", ".join(
            f"{place(h).replace(' ', '.')}={h} ({', '.join(s.name for s in plan.on_host(h))})" for h in hosts),
        f"#SBATCH --job-name={plan.deployment}",
        f"#SBATCH --output={plan.deployment}-%j.out",
    ]
    for ci, comp in enumerate(comps):
        if ci:
            out.append("#SBATCH hetjob")
        out += [f"#SBATCH --nodes={len(comp)}", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
        if _gpus(plan, comp):
            out.append(f"#SBATCH --gpus-per-node={_gpus(plan, comp)}")
    out += ["set -euo pipefail", "",
            f"export RAILYARD_START_TIMEOUT={timeout}",
            "RAILYARD_MEMBER=$(cat <<'RAILYARD_MEMBER_END'", member.rstrip("\n"), "RAILYARD_MEMBER_END", ")",
            "export RAILYARD_MEMBER"]
    if het:
        for ci, comp in enumerate(comps):
            out += [f'mapfile -t NODES_{ci} < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{ci}")',
                    f'[ "${{#NODES_{ci}[@]}}" -eq {len(comp)} ] || {{ echo "railyard: component {ci} has '
                    f'${{#NODES_{ci}[@]}} nodes, the plan {len(comp)}" >&2; exit 2; }}']
        out += ['step() {  # COMPONENT NODE ARGS...: one step on node NODE of the job\'s component COMPONENT',
                '    local c=$1 k=$2; shift 2',
                '    srun --het-group="$c" --nodes=1 --ntasks=1 --relative="$k" --overlap --kill-on-bad-exit=1 '
                'bash -c "$RAILYARD_MEMBER" member "$@"',
                '}']
    else:
        out += ['mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
                f'[ "${{#NODES[@]}}" -eq {n} ] || {{ echo "railyard: the job has ${{#NODES[@]}} nodes, the plan {n}" >&2; '
                'exit 2; }',
                'step() {  # NODE ARGS...: one step on node NODE of the job',
                '    local k=$1; shift',
                '    srun --nodes=1 --ntasks=1 --relative="$k" --overlap --kill-on-bad-exit=1 bash -c "$RAILYARD_MEMBER" member "$@"',
                '}']
    out += [
            "STEPS=()",
            '# shellcheck disable=SC2317  # run by the EXIT trap',
            'stop_steps() {  # a failed gate or the end: every step removes its container before the job ends',
            '    [ "${#STEPS[@]}" -eq 0 ] || kill -TERM "${STEPS[@]}" 2>/dev/null || true',
            '    wait',
            '}',
            "trap stop_steps EXIT", ""]
    heads: dict[int, str] = {}
    for stage in plan.stages:
        for svc in stage.services:
            _, k, head_node = next(x for x in starts if x[0] is svc)
            group = plan.group(svc.group) if svc.group else [svc]
            if any("head_addr" == getattr(a, "name", "") for a in svc.spec.command) and head_node not in heads:
                var = f"HEAD_ADDR_{head_node}"
                iface = dict(group[0].spec.env).get("NCCL_SOCKET_IFNAME") or inv.host(group[0].host).serve_rail.name
                out.append(f'{var}=$(step {place(group[0].host)} addr {q(group[0].name)} {q(str(iface))})')
                heads[head_node] = var
            head = f'"${heads[head_node]}"' if head_node in heads else '""'
            out.append(f"echo \"railyard: starting {svc.name} on {where(svc.host)}\" >&2")
            out.append(f"step {place(svc.host)} run {q(svc.name)} {head} &")
            out.append("STEPS+=($!)")
        gates = []
        for svc in stage.services:
            _, k, head_node = next(x for x in starts if x[0] is svc)
            head = f'"${heads[head_node]}"' if head_node in heads else '""'
            gates.append((svc.name, f"step {place(svc.host)} gate {q(svc.name)} {head}"))
        failed = '|| { echo "railyard: %s failed its gates" >&2; exit 1; }'
        if len(gates) == 1:
            out.append(f"{gates[0][1]} {failed % gates[0][0]}")
            continue
        for i, (_, line) in enumerate(gates):  # a stage's gates at once, as inv launch waits on them
            out.append(f"{line} &")
            out.append(f"GATE{i}=$!")
        out += [f'wait "$GATE{i}" {failed % name}' for i, (name, _) in enumerate(gates)]
    out += ["", f"echo \"railyard: {plan.deployment} is ready: {ep.service} on {where(ep.host)}, "
            f"port {ep.port}\" >&2",
            'wait -n "${STEPS[@]}" || true', 'echo "railyard: a service stopped; ending the job" >&2', "exit 1", ""]
    text = "\n".join(out)
    return text.replace("case \"$service:$action\" in", _addr_case() + "case \"$service:$action\" in", 1)


def _addr_case() -> str:
    return ('if [ "$action" = addr ]; then rail "$3" ""; printf "%s\\n" "$NODE_ADDR"; exit 0; fi\n')
