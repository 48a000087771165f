"""`python3 -m railyard` is the `railyard` command (railyard.console), for a checkout without the console script."""

from .console import main

main()
