"""The vLLM stand-in's NixlConnector (`--kv-transfer-config '{"kv_connector":"NixlConnector",...}'`): the
side channel, the handshake and the KV pull of vLLM's NixlConnector (vllm/distributed/kv_transfer/
kv_connector/v1/nixl_connector.py, connector version 2), over real TCP between the lab's network
namespaces instead of NIXL/UCX over RDMA. Loaded by the stand-in (image/lib/nixl_sim.py); `V` is the
stand-in module (its log(), tools(), container_config(), ...). Standard library only.

- every engine (DP rank) listens on VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT + dp_rank
  (defaults localhost:5600); it serves its handshake payload (compatibility hash, engine id, block
  size, blocks) and the bytes of the KV blocks it keeps for a finished prefill (made of its weights'
  digest: a decode that reads blocks of other weights answers otherwise, vllm.kv_answer);
- a prefill with kv_transfer_params.do_remote_decode keeps the prompt's full blocks (16 tokens) until
  a decode reads them or its lease (kv_connector_extra_config.kv_lease_duration, 30 s) passes, and answers with
  kv_transfer_params as vLLM does (no full block: remote_block_ids [] and nothing kept);
- a decode with do_remote_prefill connects to remote_host:remote_port, compares the compatibility hash
  (vLLM and connector version, model, dtype, KV heads/size/layers, attention backend, KV cache dtype,
  speculative method; not TP, block counts or the number of speculative tokens) and pulls the blocks;
  a failed handshake is logged as vLLM logs it and then kills the engine with vLLM's KeyError;
- NIXL's and (UCX_LOG_LEVEL=info) UCX's lines name the transport the container would get: rc/ud over
  mlx5_N:1 with /dev/infiniband, IPC_LOCK, unlimited memlock and a rail HCA in UCX_NET_DEVICES (or
  `all`) that UCX_TLS allows; otherwise tcp over the rail's netdev; neither: NIXL_ERR_BACKEND.
"""

import hashlib
import json
import os
import resource
import socket
import subprocess
import threading
import time
import uuid as uuidlib

CONNECTOR_VERSION = 2
NIXL_VERSION = "1.5.1"
UCX_VERSION = "1.20.0"
SITE = "/usr/local/lib/python3.12/dist-packages"
CHUNK = 1 << 20


def _int_env(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _resolve(host):
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


class Nixl:
    def __init__(self, V):
        self.V = V
        self.engines = {}  # DP rank -> {"engine_id", "port", "name", "pid", "worker", "wpid", "srv"}: this process's
        self.kept = {}  # request id -> {"engine": dp, "blocks": [...], "bytes": n, "expires": t, "reads": 0}
        self.lock = threading.Lock()
        self.stats = {"xfer": [], "bytes": [], "descs": [], "failed": 0, "expired": 0}  # since the last log line
        self.prom = {}  # DP rank -> {"xfer": [...], "post": [...], "bytes": [...], "descs": [...], counters}; a
                        # multi-node instance's head also keeps its headless ranks' (record())
        self.remote = {}  # remote engine id -> transport, once per engine (UCX's endpoint config line)
        self.cfg_n = 1

    # ------------------------------------------------------------ start
    def start(self, cfg, args, engines, served, model_dir):
        V = self.V
        self.args, self.served, self.model_dir = args, served, model_dir
        extra = cfg.get("kv_connector_extra_config") or {}
        self.enforce = str(extra.get("enforce_handshake_compat", True)).lower() not in ("false", "0")
        self.backends = extra.get("backends") or ["UCX"]
        self.host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        base = _int_env("VLLM_NIXL_SIDE_CHANNEL_PORT", 5600)
        self.timeout = int(extra.get("kv_lease_duration", 30))   # vLLM 0.32's nixl/base_scheduler.py default
        self.block = args["block-size"]
        self.per_token = V.kv_bytes_per_token(args, model_dir)
        self.layers = self._model_cfg().get("num_hidden_layers") or 78
        self.tp = args["tensor-parallel-size"]
        self.hash = self.compat_hash()
        self.debug = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() == "DEBUG"
        root = str(cfg.get("engine_id") or uuidlib.uuid4())
        if "UCX_RCACHE_MAX_UNRELEASED" not in os.environ:
            V.log("Setting UCX_RCACHE_MAX_UNRELEASED to '1024' to avoid a rare memory leak in UCX when using NIXL.",
                  where="nixl_connector.py:118", who="APIServer")
        for e in engines:
            dp = e["dp_rank"]
            eid = f"{root}_dp{dp}" if e["dp_size"] > 1 else root
            wname, wpid = (e["workers"][0] if e["workers"] else (e["name"], e["pid"]))
            ent = {"engine_id": eid, "port": base + dp, "name": e["name"], "pid": e["pid"] or os.getpid(),
                   "worker": wname, "wpid": wpid or os.getpid(), "dp": dp}
            self.engines[dp] = ent
            self._prom(dp)
            V.log(f"Initializing NIXL Scheduler {eid}", where="nixl_connector.py:443", who=e["name"], pid=ent["pid"])
            for name, pid in (e["workers"] or [(e["name"], ent["pid"])]):
                V.log("NIXL is available", where="nixl_connector.py:136", who=name, pid=pid)
                self._nixl_lines(name, pid)
                V.log("Initializing NIXL wrapper", where="nixl_connector.py:757", who=name, pid=pid)
                V.log(f"Initializing NIXL worker {eid}", where="nixl_connector.py:758", who=name, pid=pid)
                V.log("Registering KV_Caches. use_mla: True, kv_buffer_device: cuda, use_host_buffer: False",
                      where="nixl_connector.py:1247", who=name, pid=pid)
            self._listen(ent)
        threading.Thread(target=self._expire, daemon=True).start()
        threading.Thread(target=self._stats_logger, daemon=True).start()

    def _prom(self, dp):
        return self.prom.setdefault(dp, {"xfer": [], "post": [], "bytes": [], "descs": [], "failed": 0, "notif": 0,
                                         "expired": 0})

    def record(self, dp, sample):
        """A transfer another process's engine made (a headless rank of this instance): its series here."""
        with self.lock:
            pr = self._prom(dp)
            for k in ("xfer", "post", "bytes", "descs"):
                pr[k].append(sample[k])

    def _model_cfg(self):
        try:
            with open(os.path.join(self.model_dir, "config.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def attn_backend(self):
        a = self.args.get("attention-backend")
        if a and a is not True:
            return str(a).upper()
        # no VLLM_ATTENTION_BACKEND: vLLM 0.30+ reads it nowhere (the lab's real 0.32 has no reference to it)
        gpus = self.V.visible_gpus()
        return "CUTLASS_MLA" if gpus and "B200" in gpus[0]["name"] else "FLASHMLA"

    def spec_method(self):
        raw = self.args.get("speculative-config")
        if not raw or raw is True:
            return None
        try:
            return json.loads(raw).get("method")
        except (ValueError, AttributeError):
            return None

    def compat_hash(self):
        """vLLM's compute_nixl_compatibility_hash: the factors that decide whether two instances can move
        KV blocks (TP, block size and block counts are checked at handshake time, not hashed)."""
        c = self._model_cfg()
        dtype = self.args.get("dtype")
        dtype = c.get("torch_dtype", "bfloat16") if dtype in (None, True, "auto") else dtype
        factors = {"vllm_version": self.V.VERSION, "nixl_connector_version": CONNECTOR_VERSION,
                   "model": self.args["model"], "dtype": f"torch.{dtype}",
                   "num_kv_heads": c.get("num_key_value_heads") or 1,
                   "head_size": (c.get("kv_lora_rank") or 512) + (c.get("qk_rope_head_dim") or 64),
                   "num_hidden_layers": c.get("num_hidden_layers") or 78,
                   "attn_backend_name": self.attn_backend(), "cache_dtype": str(self.args["kv-cache-dtype"]),
                   "cross_layers_blocks": False, "speculative_method": self.spec_method()}
        return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------ NIXL / UCX lines
    def transport(self, peer_ip=None):
        """(tls, device) as UCX would choose for this container: ("rc", "mlx5_0"), ("tcp", "enp24s0np0") or
        (None, reason)."""
        V = self.V
        hcas = V.tools().shape()["hcas"]  # RDMA device -> netdev
        netdev = None
        if peer_ip is None:  # at start: the interface holding the side-channel address
            netdev = V._rail_of(_resolve(self.host)) or "lo"
        else:
            out = subprocess.run(["ip", "-o", "route", "get", peer_ip], capture_output=True, text=True).stdout.split()
            if "dev" in out:
                netdev = out[out.index("dev") + 1]
        tls = [t.strip() for t in os.environ.get("UCX_TLS", "all").split(",") if t.strip()] or ["all"]
        neg = tls[0].startswith("^")
        names = {t.lstrip("^") for t in tls}

        def allowed(*kinds):
            if "all" in names and not neg:
                return True
            hit = any(k in names for k in kinds)
            return not hit if neg else hit

        devs = [d.strip() for d in os.environ.get("UCX_NET_DEVICES", "all").split(",") if d.strip()] or ["all"]
        cfg = V.container_config()
        rdma_ok = (os.path.exists("/dev/infiniband/uverbs0") and "IPC_LOCK" in cfg["HostConfig"]["CapAdd"]
                   and resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY)
        if rdma_ok and allowed("rc", "rc_x", "rc_mlx5", "rc_v", "rc_verbs", "ib"):
            for d in devs:
                hca = d.split(":")[0]
                if d == "all" and netdev in hcas.values():
                    return "rc", next(h for h, n in hcas.items() if n == netdev)
                if hca in hcas and d.endswith(":1") and hcas[hca] == netdev:
                    return "rc", hca
        if allowed("tcp"):
            for d in devs:
                if d == "all" or d == netdev:
                    return "tcp", netdev or "lo"
        return None, netdev

    def _nixl_lines(self, who, pid):
        p = f"({who} pid={pid}) "
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        lines = [f"{stamp} NIXL INFO    _api.py:243 NIXL version: {NIXL_VERSION}"]
        lines += [f"{stamp} NIXL INFO    _api.py:250 Discovered and loaded backend plugin: {b}"
                  for b in ("UCX", "GDS_MT", "POSIX", "GDS", "LIBFABRIC")]
        if os.environ.get("UCX_LOG_LEVEL", "").lower() in ("info", "debug", "trace"):
            lines.append(f"[{time.time():.6f}] [{socket.gethostname()}:{pid}:0]     ucp_context.c:2339 UCX  INFO  "
                         f"Version {UCX_VERSION} (loaded from {SITE}/nixl_cu12.libs/libucp.so.0)")
        for b in self.backends:
            lines.append(f"{stamp} NIXL INFO    _api.py:361 Backend {b} was instantiated")
        lines.append(f"{stamp} NIXL INFO    _api.py:251 Initialized NIXL agent: {uuidlib.uuid4()}")
        print("\n".join(p + ln for ln in lines), flush=True)

    def _ucx_ep_line(self, who, pid, tls, dev):
        """UCX_LOG_LEVEL=info: the endpoint configuration of the first connection to a remote agent."""
        if os.environ.get("UCX_LOG_LEVEL", "").lower() not in ("info", "debug", "trace"):
            return
        self.cfg_n += 1
        if tls == "rc":
            lanes = f"rma(rc_mlx5/{dev}:1) am(rc_mlx5/{dev}:1) ka(ud_mlx5/{dev}:1)"
        else:
            lanes = f"rma_am(tcp/{dev}) am(tcp/{dev}) ka(tcp/{dev})"
        print(f"({who} pid={pid}) [{time.time():.6f}] [{socket.gethostname()}:{pid}:a]      ucp_worker.c:1903 UCX  "
              f"INFO    ucp_context_0 inter-node cfg#{self.cfg_n} {lanes}", flush=True)

    # ------------------------------------------------------------ prefill side
    def _listen(self, ent):
        V = self.V
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        addr = f"tcp://{self.host}:{ent['port']}"
        try:
            srv.bind((_resolve(self.host), ent["port"]))
        except OSError as e:
            msg = "Address already in use" if e.errno == 98 else "Cannot assign requested address"
            V.fail_in(ent["name"], ent["pid"], f"{msg} (addr='{addr}')", "zmq.error.ZMQError", where="core.py:866")
        srv.listen(64)
        ent["srv"] = srv
        if self.debug:
            V.log(f"Starting listening on path: {addr}", "DEBUG", where="nixl_connector.py:520", who=ent["name"],
                  pid=ent["pid"])
        threading.Thread(target=self._serve, args=(ent, srv), daemon=True).start()

    def _serve(self, ent, srv):
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(ent, c), daemon=True).start()

    def _conn(self, ent, c):
        try:
            f = c.makefile("rwb")
            for line in f:
                msg = json.loads(line)
                if msg.get("op") == "get_meta":
                    f.write((json.dumps({"compatibility_hash": self.hash, "engine_id": ent["engine_id"],
                                         "block_size": self.block, "tp_size": self.tp,
                                         "num_blocks": 100000, "kv_cache_layout": "HND"}) + "\n").encode())
                    f.flush()
                elif msg.get("op") == "read":
                    self._send_blocks(ent, f, msg, c.getpeername()[0])
        except (OSError, ValueError):
            pass
        finally:
            c.close()

    def _send_blocks(self, ent, f, msg, peer):
        rid = msg["request_id"]
        if (ent["dp"], peer) not in self.remote:  # UCX's wireup: this side's endpoint to the reader
            self.remote[(ent["dp"], peer)] = tls, dev = self.transport(peer)
            if tls:
                self._ucx_ep_line(ent["worker"], ent["wpid"], tls, dev)
        n = len(msg.get("block_ids") or []) * self.block * self.per_token
        f.write((json.dumps({"ok": True, "bytes": n}) + "\n").encode())
        left = n
        digest = self.V.WEIGHTS["digest"] or b"\0" * 32   # the blocks carry the weights that computed them
        chunk = (digest * (CHUNK // len(digest) + 1))[:CHUNK]
        while left:
            f.write(chunk[:min(left, CHUNK)])
            left -= min(left, CHUNK)
        f.flush()
        # the decode's notification (req_id:tp_size): the blocks may be freed
        with self.lock:
            k = self.kept.pop(rid, None)
        if k is None:
            self.V.log(f"Potentially invalid KV blocks for unrecognized request {rid} were retrieved by a decode "
                       "worker. They may have expired.", "ERROR", where="nixl_connector.py:2317", who=ent["worker"],
                       pid=ent["wpid"])

    def finished_prefill(self, dp, rid, n_tokens):
        """request_finished on the prefill side (status FINISHED_LENGTH_CAPPED): the full blocks kept for
        the decode and the kv_transfer_params that go back to the proxy."""
        ent = self.engines[dp]
        full = n_tokens // self.block
        base = (abs(hash(rid)) % 50000) + 1
        blocks = list(range(base, base + full))
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": blocks,
                  "remote_engine_id": ent["engine_id"], "remote_request_id": rid, "remote_host": self.host,
                  "remote_port": ent["port"], "tp_size": self.tp}
        if self.debug:
            self.V.log(f"NIXLConnector request_finished({rid}), request_status=FINISHED_LENGTH_CAPPED, "
                       f"kv_transfer_params={{'do_remote_decode': True}}", "DEBUG", where="nixl_connector.py:676",
                       who=ent["name"], pid=ent["pid"])
        if blocks:
            with self.lock:
                self.kept[rid] = {"engine": dp, "blocks": blocks, "expires": time.monotonic() + self.timeout}
        return params

    def _expire(self):
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self.lock:
                gone = [(r, k) for r, k in self.kept.items() if k["expires"] <= now]
                for r, _ in gone:
                    del self.kept[r]
            for r, k in gone:
                ent = self.engines[k["engine"]]
                self.prom[k["engine"]]["expired"] += 1
                # vLLM 0.32's words (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py)
                self.V.log(f"Releasing expired KV blocks for request {r} which were retrieved by 0 remote worker(s) "
                           "before lease expired.", "WARNING", where="base_worker.py:3033",
                           who=ent["worker"], pid=ent["wpid"])

    # ------------------------------------------------------------ decode side
    def pull(self, dp, rid, params):
        """The decode's remote prefill: handshake (once per remote engine) and the read of the blocks.
        Returns (tokens received, the transfer's sample for the metrics or None); on a failed handshake
        the engine dies (HandshakeDead)."""
        V = self.V
        ent = self.engines[dp]
        who, pid = ent["worker"], ent["wpid"]
        blocks = params.get("remote_block_ids") or []
        if self.debug:
            V.log(f"NIXLConnector get_num_new_matched_tokens: num_computed_tokens=0, kv_transfer_params={params}",
                  "DEBUG", where="nixl_connector.py:580", who=ent["name"], pid=ent["pid"])
        if not blocks:
            return 0, None
        if not all(k in params for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")):
            V.log(f"Got invalid KVTransferParams: {params}. This request will not utilize KVTransfer", "WARNING",
                  where="nixl_connector.py:640", who=ent["name"], pid=ent["pid"])
            return 0, None
        host, port, reid = str(params["remote_host"]), int(params["remote_port"]), params["remote_engine_id"]
        ip = _resolve(host)
        t0 = time.monotonic()
        try:
            s = self._handshake(ent, ip, port, reid)
        except Exception as e:  # noqa: BLE001 (any failure is vLLM's handshake_setup_failed)
            self._dead(ent, rid, params, e)
        f = s.makefile("rwb")
        f.write((json.dumps({"op": "read", "request_id": params["remote_request_id"], "block_ids": blocks,
                             "notif": f"{params['remote_request_id']}:{self.tp}"}) + "\n").encode())
        f.flush()
        head = json.loads(f.readline() or b"{}")
        left = head.get("bytes", 0)
        got, first = 0, b""
        while left:
            b = f.read(min(left, CHUNK))
            if not b:
                break
            first += b[:32 - len(first)]
            left -= len(b)
            got += len(b)
        s.close()
        dt = time.monotonic() - t0
        sample = {"xfer": dt, "post": min(dt, 0.0002), "bytes": got, "descs": len(blocks) * self.layers,
                  "kv_weights": first.hex() if len(first) == 32 else ""}
        with self.lock:
            self.stats["xfer"].append(dt)
            self.stats["bytes"].append(got)
            self.stats["descs"].append(sample["descs"])
        self.record(dp, sample)
        if self.debug:
            V.log("Rank 0, get_finished: 0 requests done sending and 1 requests done recving", "DEBUG",
                  where="nixl_connector.py:2225", who=who, pid=pid)
        return len(blocks) * self.block, sample

    def _handshake(self, ent, ip, port, reid):
        V = self.V
        who, pid = ent["worker"], ent["wpid"]
        tls, dev = self.transport(ip)
        deadline = time.monotonic() + 5.0  # the side channel's REQ socket waits 5 s (RCVTIMEO 5000)
        s = None
        while s is None:
            try:
                s = socket.create_connection((ip, port), timeout=max(0.1, deadline - time.monotonic()))
            except OSError:
                if time.monotonic() >= deadline:
                    raise _Failure("zmq.error.Again", "Resource temporarily unavailable",
                                   ("handshake_bytes = sock.recv()", "zmq/sugar/socket.py", 'line 799, in recv'))
                time.sleep(0.2)
        s.settimeout(30)
        f = s.makefile("rwb")
        f.write(b'{"op": "get_meta", "tp_rank": 0}\n')
        f.flush()
        meta = json.loads(f.readline() or b"{}")
        if self.enforce and meta.get("compatibility_hash") != self.hash:
            s.close()
            raise _Failure("RuntimeError",
                           f"NIXL compatibility hash mismatch. Local: {self.hash}, Remote: {meta.get('compatibility_hash')}. "
                           "Prefill and decode instances have incompatible configurations. This may be due to: different "
                           "vLLM versions, models, dtypes, KV cache layouts, attention backends, etc. Both instances must "
                           "use identical configurations.Disable this check using --kv-transfer-config "
                           "'{\"kv_connector_extra_config\": {\"enforce_handshake_compat\": false}}'",
                           ("raise RuntimeError(",))
        V.log(f"NIXL compatibility check passed (hash: {meta.get('compatibility_hash')})",
              where="nixl_connector.py:880", who=who, pid=pid)
        if meta.get("engine_id") != reid:
            s.close()
            raise _Failure("RuntimeError", f"Remote NIXL agent engine ID mismatch. Expected {reid},received "
                           f"{meta.get('engine_id')}.", ("raise RuntimeError(",))
        if tls is None:
            print(f"({who} pid={pid}) [{time.time():.6f}] [{socket.gethostname()}:{pid}:a]          select.c:630  "
                  f"UCX  ERROR   no active messages transport to <no debug data>: self/memory - Destination is "
                  f"unreachable", flush=True)
            s.close()
            raise _Failure("nixl._bindings.nixlBackendError", "NIXL_ERR_BACKEND",
                           ("remote_agent_name = self.nixl_wrapper.add_remote_agent(",))
        if reid not in self.remote:
            self.remote[reid] = (tls, dev)
            self._ucx_ep_line(who, pid, tls, dev)
        return s

    def _dead(self, ent, rid, params, err):
        """A failed handshake: vLLM logs handshake_setup_failed and handshake_failed, then the worker's
        get_finished looks up the never-registered remote engine (KeyError) and the engine dies."""
        if not isinstance(err, _Failure):
            err = _Failure(type(err).__name__, str(err), ())
        who, pid = ent["worker"], ent["wpid"]
        stamp = time.strftime("%m-%d %H:%M:%S")
        reid = params.get("remote_engine_id")
        nb = len(params.get("remote_block_ids") or [])

        def err_lines(where, lines):
            for ln in lines:
                print(f"({who} pid={pid}) ERROR {stamp} [{where}] {ln}", flush=True)

        ctx = {"failure_type": "handshake_setup_failed", "request_id": None, "engine_id": ent["engine_id"],
               "remote_engine_id": reid}
        tb = ["Traceback (most recent call last):",
              f'  File "{SITE}/vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py", line 852, in '
              "_nixl_handshake"]
        tb += [f"    {x}" for x in err.where]
        err_lines("nixl_connector.py:1046", [f"NIXL transfer failure: handshake_setup_failed | Context: {ctx}"] + tb
                  + [f"{err.exc}: {err.msg}"])
        ctx = {"failure_type": "handshake_failed", "request_id": rid, "engine_id": ent["engine_id"],
               "remote_engine_id": reid, "remote_request_id": params.get("remote_request_id"),
               "remote_host": params.get("remote_host"), "remote_port": params.get("remote_port"),
               "num_local_blocks": nb, "num_remote_blocks": nb, "local_block_ids_sample": list(range(1, 1 + min(nb, 10)))}
        err_lines("nixl_connector.py:1061", [f"NIXL transfer failure: handshake_failed | Context: {ctx}"] + tb
                  + [f"{err.exc}: {err.msg}"])
        err_lines("multiproc_executor.py:932", [
            "WorkerProc hit an exception.", "Traceback (most recent call last):",
            f'  File "{SITE}/vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py", line 2232, in get_finished',
            "    block_size_ratio = self.kv_topo.block_size_ratio_from_engine_id(",
            f'  File "{SITE}/vllm/distributed/kv_transfer/kv_connector/utils.py", line 453, in '
            "block_size_ratio_from_engine_id",
            "    remote_block_size = self.remote_block_size[remote_engine_id]",
            "                        ~~~~~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^", f"KeyError: '{reid}'"])
        for ln in ("EngineCore encountered a fatal error.", f"KeyError: '{reid}'"):
            print(f"({ent['name']} pid={ent['pid']}) ERROR {stamp} [core.py:1084] {ln}", flush=True)
        raise HandshakeDead(reid)

    # ------------------------------------------------------------ stats
    def _stats_logger(self):
        every = _int_env("VLLM_LOG_STATS_INTERVAL", 10)
        while True:
            time.sleep(max(1, every))
            with self.lock:
                st, self.stats = self.stats, {"xfer": [], "bytes": [], "descs": [], "failed": 0, "expired": 0}
            if not st["xfer"]:
                continue
            n = len(st["xfer"])
            xs = sorted(st["xfer"])
            mb = [b / 2 ** 20 for b in st["bytes"]]
            p90 = xs[min(n - 1, int(round(0.9 * (n - 1))))]
            vals = {"Num successful transfers": n, "Avg xfer time (ms)": round(sum(xs) / n * 1e3, 3),
                    "P90 xfer time (ms)": round(p90 * 1e3, 3), "Avg post time (ms)": 0.2, "P90 post time (ms)": 0.2,
                    "Avg MB per transfer": round(sum(mb) / n, 3),
                    "Throughput (MB/s)": round(sum(mb) / max(sum(xs), 1e-9), 3),
                    "Avg number of descriptors": round(sum(st["descs"]) / n, 1)}
            self.V.log("KV Transfer metrics: " + ", ".join(f"{k}={v}" for k, v in vals.items()), where="loggers.py:271")

    def metrics(self, served):
        """vLLM's NixlPromMetrics, one series per engine."""
        m = f'model_name="{served}"'
        out = []
        hists = (("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", "xfer",
                  [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
                 ("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.", "post",
                  [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
                 ("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", "bytes",
                  [float(2 ** (10 + i)) for i in range(1, 25, 2)]),
                 ("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL  KV Cache transfers.",
                  "descs", [10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0,
                            20000.0, 50000.0]))
        with self.lock:
            for name, help_, key, buckets in hists:
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
                for n, pr in sorted(self.prom.items()):
                    vals = pr[key]
                    for b in buckets:
                        out.append(f'{name}_bucket{{engine="{n}",le="{b}",{m}}} {float(sum(v <= b for v in vals))}')
                    out.append(f'{name}_bucket{{engine="{n}",le="+Inf",{m}}} {float(len(vals))}')
                    out.append(f'{name}_count{{engine="{n}",{m}}} {float(len(vals))}')
                    out.append(f'{name}_sum{{engine="{n}",{m}}} {float(sum(vals))}')
            for name, help_, key in (("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
                                      "failed"),
                                     ("vllm:nixl_num_failed_notifications",
                                      "Number of failed NIXL KV Cache notifications.", "notif"),
                                     ("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire. "
                                      "NOTE: This metric is tracked on the P instance.", "expired")):
                out += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"]
                for n, pr in sorted(self.prom.items()):
                    out.append(f'{name}_total{{engine="{n}",{m}}} {float(pr[key])}')
        return "\n".join(out) + "\n"


class _Failure(Exception):
    def __init__(self, exc, msg, where):
        super().__init__(msg)
        self.exc, self.msg, self.where = exc, msg, where


class HandshakeDead(Exception):
    """The decode engine died after a failed NIXL handshake (vLLM's KeyError in get_finished)."""
