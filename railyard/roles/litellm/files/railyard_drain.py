"""railyard's routing filter for the LiteLLM proxy (LiteLLM's CustomLogger `async_filter_deployments`
hook). It leaves out
- every deployment whose model_info.id is a line of the file `drained` beside this module: `inv
  recover` writes that file to take a replica out of routing before it stops it, and empties it
  once the replica is back; LiteLLM stays up;
- on a retry, every deployment that already failed this request (LiteLLM records each failed
  attempt's deployment_id in the request's metadata, `previous_models`): a retry after a replica
  died lands on another one instead of the dead one again, before any cooldown or health check
  has taken it out.
When every deployment the router offers is drained or failed this request, the group's other deployments
serve instead, those this worker was offered before and holds back now: each LiteLLM worker process puts a
deployment its own background health check found down into cooldown (`cooldown_time`, past the restart), so
right after a replica is back one worker may offer only the next replica, the one being drained. A replica
railyard has just gated and put back is the better pick than one about to stop (tried on the real engine:
68 of 140 requests of a roll failed, LiteLLM retrying on the stopping replica). Only when there is no other
does the filter keep what the router offered: it never filters away the last deployment of a model group.
"""

import os

from litellm.integrations.custom_logger import CustomLogger

DRAINED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drained")


class Drain(CustomLogger):
    def __init__(self):
        super().__init__()
        self._seen = (None, frozenset())
        self._known = {}  # model group -> {id: deployment}: every deployment this worker was offered

    def drained(self):
        try:
            stamp = os.stat(DRAINED).st_mtime_ns
        except OSError:
            return frozenset()
        if stamp != self._seen[0]:
            with open(DRAINED) as f:
                self._seen = (stamp, frozenset(line.strip() for line in f if line.strip()))
        return self._seen[1]

    async def async_filter_deployments(self, model, healthy_deployments, messages, request_kwargs=None,
                                       parent_otel_span=None):
        known = self._known.setdefault(model, {})
        for d in healthy_deployments:
            known[ident(d)] = d
        out = self.drained() | failed_before(request_kwargs)
        if not out:
            return healthy_deployments
        kept = [d for d in healthy_deployments if ident(d) not in out]
        held_back = [d for i, d in known.items() if i not in out]
        return kept or held_back or healthy_deployments


def ident(deployment):
    return (deployment.get("model_info") or {}).get("id")


def failed_before(request_kwargs):
    """The deployment ids whose attempts at this request failed (LiteLLM's retry records)."""
    kw = request_kwargs or {}
    meta = kw.get("litellm_metadata") or kw.get("metadata") or {}
    attempts = meta.get("previous_models") if isinstance(meta, dict) else None
    return frozenset(a["deployment_id"] for a in attempts or () if isinstance(a, dict) and a.get("deployment_id"))


drain = Drain()
