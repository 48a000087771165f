"""The `railyard` console command: invoke's Program over railyard's task namespace (railyard.tasks), so that
`railyard TASK ...` from any folder is `inv TASK ...` in the checkout: the same tasks, flags, help texts and exit
codes, plus `--version`, `--list` and shell completion (`railyard --print-completion-script bash`).

    [project.scripts] railyard = "railyard.console:main"
"""

from __future__ import annotations

from importlib import metadata

from invoke import Program


def version() -> str:
    """railyard's installed version (the checkout's editable install has one too); "unknown" without metadata."""
    try:
        return metadata.version("railyard")
    except metadata.PackageNotFoundError:
        return "unknown"


def program() -> Program:
    from .tasks import ns  # imported when run: it imports every task's module
    return Program(namespace=ns, version=version(), name="railyard", binary="railyard", binary_names=["railyard"])


def main() -> None:
    program().run()
