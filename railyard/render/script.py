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

from ..errors import UsageError
from ..serving.spec import MODEL_DIR, PORT, LaunchPlan, Ref
from ..transport import q

def _knobs(command) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(flag, SERVE_VAR, default) for each `--flag value` after `vllm serve MODEL`, and the bare switches."""
    args = list(command[3:])
    pairs, switches = [], []
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
                         "host with one engine (single_node_tp or dp_ep)")
    svc = services[0]
    spec = svc.spec
    if list(spec.command[:3]) != ["vllm", "serve", MODEL_DIR]:
        raise UsageError(f"launch-script: service {svc.name} does not run `vllm serve`")
    pairs, switches = _knobs(spec.command)
    lines = [
        "#!/usr/bin/env bash",
        f"# launch_server.sh: deployment {plan.deployment} (layout {plan.layout}), rendered by railyard from",
        "# the inventory. Serves an OpenAI-compatible API on $PORT from the checkpoint in $MODEL_PATH with",
        "# the vllm on PATH (run it inside the pinned image below). Every other value can be overridden",
        "# from the environment (SERVE_*); SERVE_EXTRA_ARGS is appended word by word. An API key is",
        "# required only when VLLM_API_KEY is set in the environment (vLLM reads it there).",
        "#",
        "#   PORT=8000 MODEL_PATH=/models/glm ./launch_server.sh",
        "set -euo pipefail",
        "",
        "die() { printf 'launch_server.sh: %s\\n' \"$*\" >&2; exit 2; }",
        ': "${PORT:?set PORT: the port to serve the API on}"',
        ': "${MODEL_PATH:?set MODEL_PATH: the checkpoint folder (with config.json)}"',
        'case "$PORT" in ""|*[!0-9]*) die "PORT=$PORT: not a port number" ;; esac',
        'if [ "$PORT" -lt 1 ] || [ "$PORT" -gt 65535 ]; then die "PORT=$PORT: must be 1-65535"; fi',
        '[ -f "$MODEL_PATH/config.json" ] || die "MODEL_PATH=$MODEL_PATH: no config.json there"',
        "",
        "# Pinned: the image this deployment was validated in, and the checkpoint's revision.",
        f"IMAGE={q(spec.image)}",
        f"MODEL_REVISION={q(revision)}",
        "export IMAGE MODEL_REVISION",
        'snapshot="$(basename "$(cd "$MODEL_PATH" && pwd -P)")"',
        'if [[ "$snapshot" =~ ^[0-9a-f]{40}$ ]] && [ "$snapshot" != "$MODEL_REVISION" ]; then',
        '  die "MODEL_PATH is the snapshot of revision $snapshot, not the pinned $MODEL_REVISION"',
        "fi",
        "command -v vllm >/dev/null 2>&1 || die \"no vllm on PATH: run this inside $IMAGE\"",
    ]
    if spec.env:
        lines += ["", "# The service's environment."]
    for k, v in spec.env:
        if isinstance(v, Ref):
            raise UsageError(f"launch-script: env {k} is per-target ({v.name})")
        lines.append(f"export {k}={q(v)}")
    lines.append("")
    lines.append("# The plan's values; each one can be overridden from the environment.")
    for flag, var, default in pairs:
        if default is PORT or default is MODEL_DIR:
            continue
        if isinstance(default, Ref):
            raise UsageError(f"launch-script: {flag} is per-target ({default.name})")
        lines.append(f'[ -n "${{{var}:-}}" ] || {var}={q(default)}')
    lines.append("")
    lines.append("args=(")
    for flag, var, default in pairs:
        if default is PORT:
            lines.append(f'  {flag} "$PORT"')
        elif default is MODEL_DIR:
            lines.append(f'  {flag} "$MODEL_PATH"')
        else:
            lines.append(f'  {flag} "${var}"')
    for a in switches:
        lines.append(f"  {q(a)}")
    lines.append(")")
    lines.append('read -r -a extra <<< "${SERVE_EXTRA_ARGS:-}"')
    lines.append('exec vllm serve "$MODEL_PATH" "${args[@]}" "${extra[@]}"')
    return "\n".join(lines) + "\n"

