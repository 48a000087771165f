"""`inv bench`: AIPerf sweeps against any layout's endpoint, SLO verdicts, the results table, plots,
launch-flag sweeps with restore, and comparison with an earlier run.

aiperf (the venv, the command, the export's parser), slo (the --slo expressions), run (the
orchestration: endpoint, key, tokenizer, tunnel, sweep, restore), plots (matplotlib, Agg), view
(the table and the --json report).
"""
