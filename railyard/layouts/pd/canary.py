"""The pd layout's canary targets: every prefill/decode pair, asked as the proxy asks it, then the proxy.

Through the proxy a request lands on whichever pair its round robin picks, so one wrong instance fails
the proxy's canary now and then and names nothing. A pair is asked the way vllm-router and vLLM's own
P/D proxy ask it: the request to the prefill instance with `kv_transfer_params.do_remote_decode` and
max_tokens 1 (the prefill keeps the prompt's KV blocks for the decode side and answers with the
kv_transfer_params that find them), then the same request to the decode instance with those params (it
reads the blocks over NIXL and decodes). Both go from the proxy's host, which reaches every instance;
both carry one X-Request-Id, as the proxy sends them.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from ...plan.spec import Endpoint, LaunchPlan
from ...transport import Session
from ...transport.http import request
from . import POOLS, serving

TIMEOUT_S = 120
# what the proxy sends with the prefill request (vllm-router 0.1.17 and vLLM's toy_proxy_server.py)
TO_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class Pair:
    prefill: Endpoint
    decode: Endpoint
    host: str    # the host both requests are sent from: the proxy's

    @property
    def service(self) -> str:
        return f"{self.prefill.service}>{self.decode.service}"

    @property
    def model(self) -> str:
        return self.decode.model

    def complete(self, s: Session, body: dict) -> tuple[int, str]:
        rid = ("X-Request-Id", f"railyard-canary-{secrets.token_hex(8)}")
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params=TO_PREFILL)
        code, _, text, _ = request(s, self.prefill, "/v1/chat/completions", first, TIMEOUT_S, headers=(rid,))
        if code != 200:
            return code, f"{self.prefill.service} (prefill): {text.strip()}"
        try:
            params = json.loads(text)["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            params = None
        if not isinstance(params, dict):
            return 0, f"{self.prefill.service} (prefill) answered without kv_transfer_params: {text.strip()}"
        code, _, text, _ = request(s, self.decode, "/v1/chat/completions", dict(body, kv_transfer_params=params),
                                   TIMEOUT_S, headers=(rid,))
        return code, text if code == 200 else f"{self.decode.service} (decode): {text.strip()}"


def targets(plan: LaunchPlan) -> list:
    """Every pair of a serving prefill instance and a serving decode instance, then the proxy."""
    model = plan.endpoint.model
    pools = {pool: [Endpoint.of(x, model) for x in serving(plan) if x.role == pool] for pool in POOLS}
    return [Pair(p, d, plan.endpoint.host) for p in pools["prefill"] for d in pools["decode"]] + [plan.endpoint]
