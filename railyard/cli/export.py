"""inv export: the plan for a scheduler that runs it (Kubernetes LWS manifests, a Slurm batch script); no SSH."""

from __future__ import annotations

import sys

from ..errors import UsageError
from . import console, load, rtask


@rtask(help={"to": "lws (Kubernetes LeaderWorkerSet manifests) or slurm (an sbatch script)",
             "out": "write the files into DIR (created if missing)",
             "model-volume": "lws: the checkpoint's volume, pvc:CLAIM or hostPath:/PATH (default: pvc:<deployment>-model)",
             "rdma-resource": "lws: the RDMA device plugin's resource (default rdma/rdma_shared_device_a)",
             "test-only": "slurm: then ask the cluster with sbatch --test-only whether it could run the job (exit 1 if not)"})
def export(inventory=None, to=None, out=None, model_volume=None, rdma_resource=None, test_only=False, set_=None):
    """Render the plan for a scheduler that runs it: Kubernetes (LWS) manifests or a Slurm batch script; no SSH."""
    from ..verbs.export import TARGETS
    from ..verbs.export import export as run
    from ..verbs.export import test_only as ask
    if test_only and to != "slurm":
        raise UsageError("--test-only: for --to slurm (sbatch --test-only)")
    if not to:
        raise UsageError(f"--to: one of {', '.join(TARGETS)}")
    if not out:
        raise UsageError("--out DIR: where to write the manifests or the batch script")
    paths = run(load(inventory, set_), to, out, model_volume, rdma_resource)
    how = "kubectl apply -f" if to == "lws" else "sbatch"
    console().print(f"wrote {', '.join(str(p) for p in paths)}; no host was contacted. Run: {how} {paths[0]}")
    if test_only:
        fits, said = ask(paths[0])
        print(f"{'fits' if fits else 'does not fit'}: sbatch --test-only {paths[0].name}: {said}",
              file=sys.stdout if fits else sys.stderr)
        return 0 if fits else 1
    return 0
