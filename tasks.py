"""railyard tasks: each is declared once, beside its view, in a module of railyard/cli; this file only
puts them into one namespace. `inv --help TASK` shows a task's flags.

Inventory: `--inventory PATH` on every task, or RAILYARD_INVENTORY.
Exit codes: 0 ok, 1 a check or operation failed, 2 usage or inventory error.
The lab's tasks (`inv lab.*`) are here only where the lab distribution is installed (pip install -e lab).
"""

import sys

from invoke import Collection, Task

from railyard.cli import (bench, capacity, collect, export, hang, health, hosts, nccl, preflight, rdma, recover, serve,
                          sync, verify)

ns = Collection()
for module in (preflight, hosts, sync, serve, verify, health, recover, nccl, rdma, capacity, export, collect, bench,
               hang):
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
