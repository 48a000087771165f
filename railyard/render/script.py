"""A one-host plan as a self-contained `launch_server.sh`, for systems that run a script
(a verifier that sets PORT and MODEL_PATH, a supervisor, a batch job).

The script serves with the `vllm` on its PATH (it runs inside the pinned image), reads PORT
and MODEL_PATH from its environment, lets every other value of the plan be overridden by a
SERVE_* variable, and fails with one clear line when something is missing. It carries the image
digest and the model revision it was validated with and refuses a Hugging Face snapshot of
another revision. It needs nothing outside its folder.
"""

from __future__ import annotations

import re
from typing import Sequence

from ..errors import UsageError
from ..plan.spec import MODEL_DIR, PORT, LaunchPlan, Ref, Value
from . import templates

def _knobs(command: Sequence[Value]) -> tuple[list[tuple[str, str, Value]], list[Value]]:
    """(flag, SERVE_VAR, default) for each `--flag value` after `vllm serve MODEL`, and the bare switches."""
    args = list(command[3:])
    pairs: list[tuple[str, str, Value]] = []
    switches: list[Value] = []
    i = 0
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        if isinstance(a, str) and a.startswith("--") and nxt is not None and not (isinstance(nxt, str) and nxt.startswith("--")):
            pairs.append((a, "SERVE_" + re.sub(r"[^A-Z0-9]", "_", a[2:].upper()), nxt))
            i += 2
        else:
            switches.append(a)
            i += 1
    return pairs, switches


def render(plan: LaunchPlan, revision: str) -> str:
    services = plan.services()
    if len(services) != 1:
        raise UsageError(f"launch-script: layout {plan.layout} runs {len(services)} services; a script serves one "
                         "host with one engine (a one-host layout)")
    svc = services[0]
    spec = svc.spec
    if list(spec.command[:3]) != ["vllm", "serve", MODEL_DIR]:
        raise UsageError(f"launch-script: service {svc.name} does not run `vllm serve`")
    pairs, switches = _knobs(spec.command)
    for name, v in list(spec.env) + [(flag, d) for flag, _, d in pairs if d not in (PORT, MODEL_DIR)]:
        if isinstance(v, Ref):
            raise UsageError(f"launch-script: {name} is per-target ({v.name})")
    words: dict[Value, str] = {PORT: '"$PORT"', MODEL_DIR: '"$MODEL_PATH"'}
    return templates.render(
        "vllm", "launch_server.sh.j2", deployment=plan.deployment, layout=plan.layout, image=spec.image,
        revision=revision, env=list(spec.env), knobs=[p for p in pairs if p[2] not in (PORT, MODEL_DIR)],
        args=[(flag, words.get(d, f'"${var}"')) for flag, var, d in pairs], switches=switches)
