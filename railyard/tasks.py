"""railyard's task namespace, one for both commands: `railyard` (the console command, railyard.console) and
`inv` in the checkout (its tasks.py is this namespace). Each task is declared once, beside its view, in a
module of railyard/cli; this module only puts them into one namespace. `railyard --help TASK` shows a task's
flags.

Inventory: `--inventory PATH` on every task, or RAILYARD_INVENTORY.
Exit codes: 0 ok, 1 a check or operation failed, 2 usage or inventory error.
The lab's tasks (`lab.*`) are here only where the lab distribution is installed (pip install -e lab): it is
test tooling, never in railyard's wheel.
"""

import sys

from invoke import Collection, Task

from .cli import (bench, capacity, collect, discover, export, hang, health, hosts, nccl, preflight, rdma, recover,
                  roll, serve, sync, verify)

ns = Collection()
for module in (discover, preflight, hosts, sync, serve, verify, health, recover, roll, nccl, rdma, capacity, export,
               collect, bench, hang):
    for value in vars(module).values():
        if isinstance(value, Task):
            ns.add_task(value)

try:
    import railyard_lab.tasks
except ImportError as e:
    if not (e.name or "railyard_lab").startswith("railyard_lab"):  # installed, but something it needs is not
        print(f"warning: no lab.* tasks: {e}", file=sys.stderr)
else:
    ns.add_collection(railyard_lab.tasks.ns)
