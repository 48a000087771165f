"""railyard tasks. Each parses its flags and calls the library; `inv --help TASK` shows the flags.

Inventory: `--inventory PATH` on every task, or RAILYARD_INVENTORY.
Exit codes: 0 ok, 1 a check or operation failed, 2 usage or inventory error.
"""

from invoke import Collection, task

from railyard import cli

INVENTORY = "inventory YAML file (default: $RAILYARD_INVENTORY)"
SET = "override a variable, KEY=VALUE (repeatable; highest precedence)"
JSON = "print one JSON document instead of the table"


def _int(value, flag):
    return cli.number(value, flag, int)


def _num(value, flag):
    return cli.number(value, flag, float)


@task(help={"inventory": INVENTORY, "json": JSON, "set": SET}, iterable=["set_"])
def preflight(c, inventory=None, json=False, set_=None):
    """Check every host before launch: rails, MTU, jumbo ping, GID, clocks, disk, GPU, Docker, image, SSH."""
    cli.preflight(inventory, json, set_)


@task(name="trust-hosts",
      help={"inventory": INVENTORY, "hosts": "only these hosts, comma-separated (default: all)",
            "accept": "record keys not yet in known_hosts", "replace": "replace keys that CHANGED (verify first!)",
            "set": SET}, iterable=["set_"])
def trust_hosts(c, inventory=None, hosts=None, accept=False, replace=False, set_=None):
    """Show each host's SSH host key fingerprint; record it only with --accept (or --replace)."""
    cli.trust_hosts(inventory, hosts, accept, replace, set_)


@task(name="sync-model",
      help={"inventory": INVENTORY, "source": "copy from this host (default: the head)",
            "to": "copy to these hosts, comma-separated (default: every other host)",
            "verify": "content (sha256 of every file, the default) or size (names and sizes only)",
            "streams": "parallel rsync streams per target (default: sync_streams)",
            "dry-run": "show the plan and the exact commands; change nothing",
            "repair": "re-send only the files that differ (and remove extra ones), then verify again",
            "json": JSON, "rehash": "ignore the hosts' digest caches and hash every file again",
            "bwlimit": "limit each rsync stream to this many MB/s", "set": SET,
            "transport": "ssh (rsync over SSH, the default: sync_transport) or rsyncd (a one-time rsync daemon "
                         "on each target's rail address, unencrypted: for public weights on direct links)"},
      iterable=["set_"])
def sync_model(c, inventory=None, source=None, to=None, verify=None, streams=None, dry_run=False, repair=False,
               json=False, rehash=False, bwlimit=None, set_=None, transport=None):
    """Copy the checkpoint from the head to every other rank with rsync and prove the copies equal."""
    cli.sync_model(inventory, source, to, verify, _int(streams, "--streams"), dry_run, repair, json, rehash,
                   _num(bwlimit, "--bwlimit"), set_, transport)


@task(help={"inventory": INVENTORY, "check": "show the diff against the hosts and change nothing (exit 1 if any differ)",
            "set": SET}, iterable=["set_"])
def env(c, inventory=None, check=False, set_=None):
    """Render one env file per service (GPUs, GID index, IPs from the hosts) into env/ and onto each host, 0600."""
    cli.env(inventory, check, set_)


RANK_ORDER = "start order, e.g. B,A (default: workers first, then the head)"
TIMEOUT = "seconds to wait for `Application startup complete` and /health (default: vllm_start_timeout_s)"


@task(help={"inventory": INVENTORY, "rank-order": RANK_ORDER, "dry-run": "print the exact docker run per host; change nothing",
            "recreate": "replace containers that exist with another configuration (or stopped)",
            "timeout": TIMEOUT, "rollback": "on failure, stop and remove what this launch started",
            "json": JSON + " (the live table goes to stderr)", "set": SET},
      iterable=["set_"])
def launch(c, inventory=None, rank_order=None, dry_run=False, recreate=False, timeout=None, rollback=False, json=False,
           set_=None):
    """Start the layout's services stage by stage, gated, until its endpoint serves /health; then each vLLM
    container's bring-up timeline (weights, KV cache, engine, API) beside the previous launch's."""
    cli.launch(inventory, rank_order, dry_run, recreate, _num(timeout, "--timeout"), rollback, set_, json_out=json)


@task(name="launch-script", help={"inventory": INVENTORY, "out": "write DIR/launch_server.sh (created if missing)",
                                  "set": SET}, iterable=["set_"])
def launch_script(c, inventory=None, out=None, set_=None):
    """Write a self-contained launch_server.sh for a one-host layout (reads PORT and MODEL_PATH); no SSH."""
    cli.launch_script(inventory, out, set_)


@task(help={"inventory": INVENTORY, "to": "lws (Kubernetes LeaderWorkerSet manifests) or slurm (an sbatch script)",
            "out": "write the files into DIR (created if missing)",
            "model-volume": "lws: the checkpoint's volume, pvc:CLAIM or hostPath:/PATH (default: pvc:<deployment>-model)",
            "rdma-resource": "lws: the RDMA device plugin's resource (default rdma/rdma_shared_device_a)",
            "test-only": "slurm: then ask the cluster with sbatch --test-only whether it could run the job (exit 1 if not)",
            "set": SET},
      iterable=["set_"])
def export(c, inventory=None, to=None, out=None, model_volume=None, rdma_resource=None, test_only=False, set_=None):
    """Render the plan for a scheduler that runs it: Kubernetes (LWS) manifests or a Slurm batch script; no SSH."""
    cli.export(inventory, to, out, model_volume, rdma_resource, test_only, set_)


@task(help={"inventory": INVENTORY, "set": SET}, iterable=["set_"])
def unlock(c, inventory=None, set_=None):
    """Remove the operator lock on the head (launch, start, stop and sync-model take it), naming its owner."""
    cli.unlock(inventory, set_)


@task(help={"inventory": INVENTORY, "set": SET}, iterable=["set_"])
def stop(c, inventory=None, set_=None):
    """Stop the services in reverse start order (the head first; docker stop --timeout 60); confirm the GPUs are free."""
    cli.stop(inventory, set_)


@task(help={"inventory": INVENTORY, "rank-order": RANK_ORDER, "timeout": TIMEOUT, "set": SET}, iterable=["set_"])
def start(c, inventory=None, rank_order=None, timeout=None, set_=None):
    """Resume the stopped containers in start order, with the same gates as launch."""
    cli.start(inventory, rank_order, _num(timeout, "--timeout"), set_)


@task(help={"inventory": INVENTORY, "json": JSON, "set": SET}, iterable=["set_"])
def status(c, inventory=None, json=False, set_=None):
    """Per service: container state, uptime, image digest, GPU memory used."""
    cli.status(inventory, json, set_)


@task(help={"inventory": INVENTORY, "rank": "host name (B), rank number (1) or service name", "follow": "keep following",
            "lines": "only the last N lines", "set": SET}, iterable=["set_"])
def logs(c, inventory=None, rank=None, follow=False, lines=None, set_=None):
    """Show one service's container log (a one-host layout needs no --rank)."""
    cli.logs(inventory, rank, follow, _int(lines, "--lines"), set_)


@task(name="verify-rdma", help={"inventory": INVENTORY, "log": "judge this NCCL log file instead (repeatable; no SSH)",
                                "json": JSON, "set": SET}, iterable=["set_", "log"])
def verify_rdma(c, inventory=None, log=None, json=False, set_=None):
    """Prove NCCL uses GPUDirect RDMA over the rail on every rank (not a silent TCP fallback)."""
    cli.verify_rdma(inventory, log, json, set_)


@task(help={"inventory": INVENTORY, "json": JSON, "watch": "repeat every N seconds as a live view",
            "cache-proof": "replicas layout: one long new prompt to r0, then to r1; r1 must reuse r0's KV from LMCache",
            "proof-words": "length of that prompt in words (default 16384, or half the engine's max_model_len when "
                           "shorter)", "set": SET},
      iterable=["set_"])
def health(c, inventory=None, json=False, watch=None, cache_proof=False, proof_words=None, set_=None):
    """Services up and on their GPUs; the endpoint's /health, /v1/models, a real chat completion, /metrics."""
    from railyard.layouts.replicas.health import PROOF_WORDS_AUTO
    words = _int(proof_words, "--proof-words") if proof_words is not None else PROOF_WORDS_AUTO
    cli.health(inventory, json, _num(watch, "--watch"), set_, cache_proof=words if cache_proof else 0)


@task(help={"inventory": INVENTORY, "replica": "restart this replica (r0, r1, ...) even if healthy: a planned restart",
            "dry-run": "print the path recover would take and why; change nothing",
            "timeout": "seconds each start may take to pass its gates (default: vllm_start_timeout_s)",
            "drain-timeout": "seconds to wait for a drained replica's requests in flight (default 300)",
            "json": JSON, "set": SET}, iterable=["set_"])
def recover(c, inventory=None, replica=None, dry_run=False, timeout=None, drain_timeout=None, json=False, set_=None):
    """Replicas layout: bring a crashed replica back (alone, or with LMCache when it holds the GPUs)."""
    cli.recover(inventory, replica, dry_run, _num(timeout, "--timeout"),
                _num(drain_timeout, "--drain-timeout") if drain_timeout is not None else 300.0, json, set_)


@task(help={"inventory": INVENTORY, "compose": "write DIR/docker-compose.yml and the files it mounts", "set": SET},
      iterable=["set_"])
def render(c, inventory=None, compose=None, set_=None):
    """Write the deployment in another form (a Docker Compose project), rendered from the same plan."""
    cli.render(inventory, compose, set_)


@task(name="nccl-check", help={"inventory": INVENTORY, "sizes": "message sizes, e.g. 1M,16M,256M,1G (default: nccl_check_sizes)",
                               "timeout": "seconds the probe may run (default: nccl_check_timeout_s)",
                               "json": JSON, "set": SET}, iterable=["set_"])
def nccl_check(c, inventory=None, sizes=None, timeout=None, json=False, set_=None):
    """All-reduce in short-lived containers before launch, over the rail (two stations) or across the GPUs of one host: transport and bandwidth."""
    cli.nccl_check(inventory, sizes, _num(timeout, "--timeout"), json, set_)


@task(name="up", help={"hosts": "number of test hosts (A, B, C, ...); default 2, or what --layout needs",
                       "shape": "station (a DGX Station: GB300 + display GPU, 2 rails; default) or hgx8 "
                                "(8 GPUs on 2 NUMA nodes, 8 rails); another shape rebuilds the lab",
                       "gpu": "the GPUs of an hgx8 host: H200 (default) or B200",
                       "slurm": "also a real Slurm cluster over the hosts (munged, slurmctld, a slurmd per host; "
                                "clients: SLURM_CONF=<lab>/slurm/slurm.conf)",
                       "engine": "what serves: vllm (the real vLLM, its CPU build; the default) or stand-in "
                                 "(the lab's own; kept until changed)",
                       "layout": "write the lab inventory for this serve_layout on the hosts it needs: multinode_tp "
                                 "(2 stations), single_node_tp, dp_ep, replicas (1 hgx8 host), pd (2 hgx8 hosts)"})
def lab_up(c, hosts=None, shape=None, gpu="H200", slurm=False, engine=None, layout=None):
    """Start the lab: N test hosts as network namespaces with sshd, rails and simulated GPU tools."""
    cli.lab_up(None if hosts is None else cli.number(hosts, "--hosts"), shape, gpu, slurm, engine, layout)


@task(name="down")
def lab_down(c):
    """Remove everything the lab made: namespaces, links, processes, files."""
    cli.lab_down()


@task(name="fault", positional=["host", "kind"],
      help={"host": "lab host, e.g. B", "kind": "fault kind (see the list above); KIND=VALUE also works",
            "value": "optional value, e.g. an MTU or a number of seconds"})
def lab_fault(c, host, kind, value=""):
    """Inject a fault: inv lab.fault B mtu --value 1500 (or B mtu=1500). Kinds: mtu, link-down, no-ip,
    gid-index, ntp-unsynced, clock-skew, gpu-busy, no-gpu, disk-full, sshd-down, host-key-changed,
    missing-tool, docker-down, image-mismatch."""
    if "=" in kind and not value:
        kind, value = kind.split("=", 1)
    cli.lab_fault(host, kind, value or None)


@task(name="heal", help={"host": "heal only this host (default: every host)"})
def lab_heal(c, host=""):
    """Undo the faults injected with lab.fault."""
    cli.lab_heal(host or None)


@task(name="checkpoint", help={"size-gb": "total size of the padding shards in GB (default 0.5)",
                               "shards": "number of padding safetensors shards, which the engine ignores (default 10)",
                               "host": "where to write it (default: the head, A)"})
def lab_checkpoint(c, size_gb=0.5, shards=10, host=None):
    """Write the lab checkpoint on the head: the lab's real tiny model (the MoE one for dp_ep) and padding shards."""
    cli.lab_checkpoint(float(size_gb), int(shards), host)


@task(name="ssh", help={"host": "lab host, e.g. A"})
def lab_ssh(c, host):
    """Open a shell on a lab host, or run one command there: inv lab.ssh A -- ip -br addr."""
    cli.lab_ssh(host, cli.remainder() or None)


lab = Collection("lab", lab_up, lab_down, lab_fault, lab_heal, lab_checkpoint, lab_ssh)
ns = Collection(preflight, trust_hosts, sync_model, env, launch, launch_script, start, stop, unlock, status, logs,
                verify_rdma, health,
                nccl_check, lab)


# ---------------------------------------------------------------- plan
# Defined after `ns` and added to it here, so this section stays append-only.

@task(help={"inventory": INVENTORY, "json": JSON, "set": SET,
            "model": "checkpoint directory on this machine (default: model_path on the head, read over SSH)",
            "gpu-memory-gib": "memory per GPU in GiB, e.g. for a host not bought yet (default: the head's nvidia-smi)",
            "gpus": "GPUs on the host (default: the head's GPUs matching cluster_gpu_name)",
            "context": "tokens per request for the concurrency column (default: max_position_embeddings)",
            "gpu-memory-utilization": "vLLM's --gpu-memory-utilization (default 0.9, vLLM's default)",
            "kv-cache-dtype": "vLLM's --kv-cache-dtype: auto (the model dtype), bfloat16, float16, fp8 ... (default auto)",
            "reserve-gib": "per GPU: peak activation + CUDA graphs + non-torch memory vLLM keeps out of the KV "
                           "cache (default 8)",
            "dp-reserve-gib": "the same reserve for each dp_ep rank, if it differs (default: --reserve-gib)",
            "block-size": "KV block size (default: 64 for MLA, 16 otherwise)",
            "mtp": "count the MTP layers' weights and KV (as with --speculative-config method=mtp)",
            "against-engine": "the running deployment instead: each engine's planned KV tokens beside the "
                              "`GPU|CPU KV cache size` it printed, and the difference in percent"},
      iterable=["set_"])
def plan(c, inventory=None, model=None, gpu_memory_gib=None, gpus=None, context=None, json=False,
         gpu_memory_utilization=None, kv_cache_dtype=None, reserve_gib=None, block_size=None, mtp=False,
         dp_reserve_gib=None, set_=None, against_engine=False):
    """KV cache per GPU and per node under TP=N against DP attention + EP, from the checkpoint's own headers."""
    cli.plan(inventory, model, _num(gpu_memory_gib, "--gpu-memory-gib"), _int(gpus, "--gpus"),
             _int(context, "--context"), json, _num(gpu_memory_utilization, "--gpu-memory-utilization"),
             kv_cache_dtype, _num(reserve_gib, "--reserve-gib"), _int(block_size, "--block-size"), mtp,
             _num(dp_reserve_gib, "--dp-reserve-gib"), set_, against_engine=against_engine)


ns.add_task(plan)
ns.add_task(recover)
ns.add_task(render)
ns.add_task(export)


@task(help={"inventory": INVENTORY, "out": "the archive to write (default: railyard-collect-<deployment>-<stamp>.tar.gz)",
            "no-preflight": "leave preflight's checks out (faster)", "set": SET}, iterable=["set_"])
def collect(c, inventory=None, out=None, no_preflight=False, set_=None):
    """One .tar.gz for the on-call ticket: every host's state, logs, NCCL logs and verdicts, no secret."""
    cli.collect(inventory, out, not no_preflight, set_)


ns.add_task(collect)


@task(help={"inventory": INVENTORY, "concurrency": "concurrencies, comma-separated (default 1,8,16,32)",
            "isl": "synthetic prompt length in tokens (default 128)", "osl": "output length in tokens (default 64)",
            "isl-stddev": "spread of the prompt length (default 0)", "osl-stddev": "spread of the output length (default 0)",
            "dataset": "a JSONL file of prompts ({\"text\": ...} per line) instead of synthetic ones",
            "prefix-prompts": "shared prefixes to draw from (with --prefix-length)",
            "prefix-length": "tokens of each shared prefix",
            "warmup": "warm-up requests per unit of concurrency, excluded (default 3: 3 x C)",
            "requests": "measured requests per unit of concurrency (default 10: 10 x C)",
            "seed": "AIPerf's random seed (default 1)",
            "slo": "METRIC<=V or METRIC>=V, e.g. per_user_tok_s>=30, ttft_mean_s<=2.5, tpot_mean_ms<=20 (repeatable)",
            "require": "a failed SLO exits 1 (without it: shown, exit 0)",
            "sweep": "FLAG=V1,V2,...: relaunch with each value of one launch flag (e.g. max_num_batched_tokens=2048,8192), "
                     "benchmark each, then restore the original",
            "compare": "an earlier run's directory (or its summary.json): deltas in the table, both on the plots",
            "out": "results root (default ./bench): OUT/<deployment>/<stamp>/",
            "tokenizer": "a local tokenizer directory (default: the checkpoint's own files, fetched from the host)",
            "timeout": "seconds to wait for each relaunch of a sweep (default vllm_start_timeout_s)",
            "where": "where AIPerf runs: control (this machine, the default) or head (the endpoint's host, "
                     "its AIPerf at bench_aiperf_venv)",
            "json": JSON, "set": SET}, iterable=["set_", "slo"])
def bench(c, inventory=None, concurrency=None, isl=None, osl=None, isl_stddev=0, osl_stddev=0, dataset=None,
          prefix_prompts=0, prefix_length=0, warmup=3, requests=10, seed=1, slo=None, require=False, sweep=None,
          compare=None, out=None, tokenizer=None, timeout=None, json=False, set_=None, where=None):
    """Benchmark the endpoint with AIPerf: a table per concurrency, SLO verdicts, PNG plots, sweeps of launch flags."""
    cli.bench(inventory, concurrency, _int(isl, "--isl"), _int(osl, "--osl"), _int(isl_stddev, "--isl-stddev"),
              _int(osl_stddev, "--osl-stddev"), dataset, _int(prefix_prompts, "--prefix-prompts"),
              _int(prefix_length, "--prefix-length"), _int(warmup, "--warmup"), _int(requests, "--requests"),
              _int(seed, "--seed"), slo, require, sweep, compare, out, tokenizer, _num(timeout, "--timeout"), json, set_,
              where)


ns.add_task(bench)
