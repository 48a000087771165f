"""railyard's tasks for `inv` in the checkout: the same namespace as the installed `railyard` command
(railyard/tasks.py composes it; each task is declared once, beside its view, in railyard/cli).
`inv --help TASK` shows a task's flags.

Inventory: `--inventory PATH` on every task, or RAILYARD_INVENTORY.
Exit codes: 0 ok, 1 a check or operation failed, 2 usage or inventory error.
The lab's tasks (`inv lab.*`) are here only where the lab distribution is installed (pip install -e lab).
"""

from railyard.tasks import ns

__all__ = ["ns"]
