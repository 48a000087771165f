"""railyard's routing filter for the LiteLLM proxy (LiteLLM's CustomLogger `async_filter_deployments`
hook). It leaves out
- every deployment whose model_info.id is a line of the file `drained` beside this module: `inv
  recover` writes that file to take a replica out of routing before it stops it, and empties it
  once the replica is back; LiteLLM stays up;
- on a retry, every deployment that already failed this request (LiteLLM records each failed
  attempt's deployment_id in the request's metadata, `previous_models`): a retry after a replica
  died lands on another one instead of the dead one again, before any cooldown or health check
  has taken it out.
It never filters away the last deployment of a model group.
"""

import os

from litellm.integrations.custom_logger import CustomLogger

DRAINED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drained")


class Drain(CustomLogger):
    def __init__(self):
        super().__init__()
        self._seen = (None, frozenset())

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
        out = self.drained() | failed_before(request_kwargs)
        if not out:
            return healthy_deployments
        kept = [d for d in healthy_deployments if (d.get("model_info") or {}).get("id") not in out]
        return kept or healthy_deployments


def failed_before(request_kwargs):
    """The deployment ids whose attempts at this request failed (LiteLLM's retry records)."""
    kw = request_kwargs or {}
    meta = kw.get("litellm_metadata") or kw.get("metadata") or {}
    attempts = meta.get("previous_models") if isinstance(meta, dict) else None
    return frozenset(a["deployment_id"] for a in attempts or () if isinstance(a, dict) and a.get("deployment_id"))


drain = Drain()
