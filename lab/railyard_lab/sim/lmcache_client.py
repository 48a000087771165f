"""The vLLM stand-in's LMCache side: a real LMCache MP client, run by the lab engine venv's python
(LMCache is installed there, beside vLLM).

The stand-in (stdlib only) starts this once per `vllm serve` with --kv-transfer-config
LMCacheMPConnector and talks to it in JSON lines over stdin/stdout. It does what vLLM's LMCache
connector does through LMCache's own client library: it registers one KV cache per worker rank
(one instance id per GPU) with the real server, pings it every heartbeat interval, and per request
looks the prompt's token ids up, retrieves the hit prefix and stores the rest, rank by rank. The
KV caches are small CPU tensors (the lab has no GPU memory to share): the server reaches them
through POSIX shared memory as it reaches a GPU's through CUDA IPC.

Requests (one JSON object a line) and replies:
  {"op": "lookup", "id": R, "tokens": [...]}           -> {"hit": tokens found (chunk-aligned)}
  {"op": "retrieve", "id": R, "tokens": [...], "n": N} -> {"ok": bool, "s": seconds}
  {"op": "store", "id": R, "tokens": [...], "start": S} -> {"ok": bool, "s": seconds}
  {"op": "end", "id": R}                                -> {"ok": true}
  {"op": "close"}                                       -> unregisters every rank, exits
On start it prints {"registered": [instance ids], "chunk": chunk size} or {"error": "..."}.
"""

import argparse
import json
import os
import sys
import threading
import time
import uuid


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--model", default="model")
    ap.add_argument("--mq-timeout", type=float, default=300.0)
    ap.add_argument("--heartbeat", type=float, default=10.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--salt", default="")
    a = ap.parse_args()

    import torch
    import zmq
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import create_transfer_context
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    client = RequestClientFactory.create(a.url, context=ctx)
    try:
        chunk = int(client.get_chunk_size().result(timeout=a.mq_timeout))
    except TimeoutError:
        reply({"error": f"LMCache server did not respond to register_kv_caches within {a.mq_timeout}s. "
                        "Is the server running?"})
        os._exit(1)
    blocks_in_chunk = chunk // a.block_size
    groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(a.layers)), tokens_per_block=a.block_size)]
    workers = []  # (instance id, kv caches, transfer context)
    for rank in range(a.ranks):
        iid = uuid.uuid4().int & ((1 << 63) - 1)  # as the real adapter picks it
        kv = {f"model.layers.{i}.self_attn.attn": torch.zeros((2, a.blocks, a.block_size, a.heads, a.head_size),
                                                              dtype=torch.float16) for i in range(a.layers)}
        tc = create_transfer_context(kv, instance_id=iid, req_client=client, mode="lmcache_driven")
        try:
            tc.register(kv, a.model, a.world_size, blocks_in_chunk, a.mq_timeout, layout_hints={"kv_layout": "NHD"},
                        engine_group_infos=groups, engine_type=EngineType.VLLM)
        except TimeoutError:
            reply({"error": f"LMCache server did not respond to register_kv_caches within {a.mq_timeout}s. "
                            "Is the server running?"})
            os._exit(1)
        workers.append((iid, kv, tc))
    reply({"registered": [w[0] for w in workers], "chunk": chunk})
    lock = threading.Lock()
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(a.heartbeat):
            for iid, _, _ in workers:
                try:
                    with lock:
                        fut = client.ping(iid)
                    fut.result(timeout=a.heartbeat)
                except Exception:
                    pass

    threading.Thread(target=heartbeat, daemon=True).start()
    full_blocks = a.blocks

    def key(tokens, rid, start, end, worker):
        return IPCCacheServerKey(model_name=a.model, world_size=a.world_size, worker_id=worker,
                                 token_ids=tuple(tokens), start=start, end=end, request_id=rid,
                                 cache_salt=a.salt, num_kv_readers=1)

    def transfer(op, rid, tokens, start, end):
        t0 = time.monotonic()
        ok = True
        blocks = list(range(start // a.block_size, end // a.block_size))
        for rank, (iid, kv, tc) in enumerate(workers):
            k = key(tokens, rid, start, end, rank)
            with lock:
                ev = tc.create_recorded_event()
                fut = (tc.submit_store if op == "store" else tc.submit_retrieve)(rid, k, kv, [blocks], ev,
                                                                                 blocks_in_chunk)
            try:
                ok = bool(fut.result(timeout=a.mq_timeout)) and ok
            except TimeoutError:
                ok = False
        return {"ok": ok, "s": time.monotonic() - t0}

    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        op = req.get("op")
        if op == "close":
            break
        rid = req.get("id", "")
        tokens = req.get("tokens") or []
        usable = min(len(tokens), full_blocks * a.block_size)
        full = usable - usable % chunk
        try:
            if op == "lookup":
                if full == 0:
                    reply({"hit": 0})
                    continue
                with lock:
                    fut = client.lookup(key(tokens, rid, 0, full, None), a.ranks)
                fut.result(timeout=a.mq_timeout)
                hit = None
                for _ in range(int(a.mq_timeout / 0.01)):
                    with lock:
                        fut = client.query_prefetch_status(rid)
                    hit = fut.result(timeout=a.mq_timeout)
                    if hit is not None:
                        break
                    time.sleep(0.01)
                reply({"hit": int(hit or 0) * chunk})
            elif op == "retrieve":
                n = min(int(req.get("n", 0)), full)
                reply(transfer("retrieve", rid, tokens, 0, n) if n > 0 else {"ok": True, "s": 0.0})
            elif op == "store":
                start = int(req.get("start", 0))
                reply(transfer("store", rid, tokens, start, full) if full > start else {"ok": True, "s": 0.0})
            elif op == "end":
                with lock:
                    fut = client.end_session(rid)
                fut.result(timeout=a.mq_timeout)
                reply({"ok": True})
            else:
                reply({"error": f"unknown op {op!r}"})
        except TimeoutError:
            reply({"error": f"LMCache server did not answer {op} within {a.mq_timeout}s"})
        except Exception as e:  # the stand-in logs it; the request goes on without the cache
            reply({"error": f"{type(e).__name__}: {e}"})
    stop.set()
    for iid, _, tc in workers:
        try:
            tc.flush_inflight_stores()
            fut = tc.unregister()
            if fut is not None:
                fut.result(timeout=10)
        except Exception:
            pass
        try:
            tc.close()
        except Exception:
            pass
    reply({"unregistered": [w[0] for w in workers]})
    client.close()
    os._exit(0)


if __name__ == "__main__":
    main()
