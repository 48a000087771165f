"""Start AIPerf's CLI with the API key read from a pipe, so that it is in no process's argv.

Run by the AIPerf virtualenv's python (railyard.bench.aiperf.argv):
    python aiperf_main.py FD profile ...      # FD: a pipe holding the key ("" = no key)
The key joins sys.argv inside this process only (the kernel's /proc/PID/cmdline keeps the argv
of the exec); AIPerf hands it to its own workers in AIPERF_INJECTED_API_KEY and redacts
`--api-key` in the `cli_command` of its exports.
"""

import os
import sys


def command(args: list[str], key: str) -> list[str]:
    """AIPerf's arguments with the key: one word, `--api-key=KEY`, since a key that starts with "-"
    (token_urlsafe's alphabet has it) is an option to AIPerf's parser as a word of its own
    ("parameter --api-key requires an argument")."""
    return [*args] + ([f"--api-key={key}"] if key else [])


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))  # railyard/bench holds a module named aiperf too
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    fd = int(sys.argv[1])
    with os.fdopen(fd, "r") as f:
        key = f.read().strip()
    sys.argv = ["aiperf", *command(sys.argv[2:], key)]
    from aiperf.cli import app
    app()


if __name__ == "__main__":
    main()
