"""`inv export --to lws|slurm --out DIR`: the inventory's plan for a scheduler that runs it itself.

No host is contacted: what only the node knows when the job or pod starts (its $HOME, its GPUs'
UUIDs, its rail's address and RoCE v2 GID index) is left symbolic in the plan
(railyard.render.walk.placeholder_facts) and found there by the rendered script or pod.

    paths = export(inv, "lws", "out/", model_volume="pvc:glm-weights")
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..inventory import Inventory
from ..render import walk
from ..plan import layout as layouts
from ..plan.spec import LaunchPlan

TARGETS = ("lws", "slurm")


def scheduler_plan(inv: Inventory) -> LaunchPlan:
    """The layout's plan after its static checks (exit 2), with every host fact symbolic."""
    layout = layouts.validated(inv)
    _, count = layout.needs(inv)
    return layout.plan(inv, walk.placeholder_facts(inv, layout.hosts(inv), count))


def render(inv: Inventory, to: str, model_volume: str | None = None, rdma_resource: str | None = None
           ) -> dict[str, str]:
    """{file name: text} for the target."""
    plan = scheduler_plan(inv)
    if to == "lws":
        from ..render import lws
        mv = model_volume or _default_volume(inv, plan)
        return {f"{plan.deployment}.yaml": lws.render(plan, lws.ModelVolume.parse(mv),
                                                       rdma_resource or lws.DEFAULT_RDMA_RESOURCE)}
    if to == "slurm":
        from ..render import slurm
        if model_volume or rdma_resource:
            raise UsageError(f"--to slurm: {'--model-volume' if model_volume else '--rdma-resource'} is for --to lws")
        return {f"{plan.deployment}.sbatch": slurm.render(plan, inv)}
    raise UsageError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")


def _default_volume(inv: Inventory, plan: LaunchPlan) -> str:
    """The checkpoint's volume when --model-volume names none: a claim named after the deployment."""
    from ..render.lws import k8s_name
    return f"pvc:{k8s_name(plan.deployment, 'model')}"


def write(files: dict[str, str], out_dir: str, flag: str = "--out", mode: int = 0o644) -> list[Path]:
    """Each file written atomically under out_dir; an OSError is one usage line naming the flag."""
    d = Path(out_dir)
    written = []
    try:
        for rel, text in files.items():
            path = d / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            tmp.chmod(mode)
            tmp.replace(path)
            written.append(path)
    except OSError as e:
        raise UsageError(f"{flag} {out_dir}: {e.strerror}") from None
    return written


def export(inv: Inventory, to: str, out_dir: str, model_volume: str | None = None,
           rdma_resource: str | None = None) -> list[Path]:
    files = render(inv, to, model_volume, rdma_resource)
    return write(files, out_dir, mode=0o755 if to == "slurm" else 0o644)


def test_only(path: Path) -> tuple[bool, str]:
    """Ask the cluster whether it could run the batch script: `sbatch --test-only` (needs sbatch and the
    cluster's slurm.conf here). (fits, the one line sbatch said)."""
    import shutil
    import subprocess
    exe = shutil.which("sbatch")
    if exe is None:
        raise UsageError("--test-only: sbatch not found here (install slurm-client, and point SLURM_CONF at the "
                         "cluster's slurm.conf)")
    try:
        r = subprocess.run([exe, "--test-only", str(path)], capture_output=True, text=True, timeout=60,
                           cwd=path.parent)
    except subprocess.TimeoutExpired:
        return False, "sbatch --test-only: no answer from slurmctld in 60 s"
    lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    said = next((ln for ln in lines if "error" in ln or "failure" in ln), lines[-1] if lines else f"rc {r.returncode}")
    return r.returncode == 0, said.removeprefix("sbatch: ")
