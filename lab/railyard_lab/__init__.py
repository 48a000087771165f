"""The lab: test hosts on this machine, made of network namespaces with a real sshd each.

Every host has one shape (SHAPES): `station`, a DGX Station (a GB300 and an RTX PRO display
GPU, rails `cx8r0`, `cx8r1`), or `hgx8`, an 8-GPU HGX server (8 H200 or B200 on two NUMA
nodes, 8 rails `enp24s0np0` ... `enp218s0np0`). Each host `A`, `B`, ... gets:
- a network namespace `rylab-A` with a management interface `mgmt0` (198.18.0.0/24,
  bridged to the control machine) and its shape's rails (MTU 9000), each on its own
  bridge (rail k: 198.18.(100+k).0/24);
- a private mount and UTS namespace held by an anchor process, in which the host's
  own directory is bind-mounted over /root and the hostname is the host's name;
- a real `sshd` inside those namespaces, with its own host key, whose sessions get a
  PATH where simulated `ibdev2netdev`, `show_gids`, `nvidia-smi`, `lscpu`, `timedatectl` and
  `docker` come first (they read the host's real interfaces, the lab's fault state and the
  host's shape file `shape.json`, written here at up time); an hgx8 host also has `vllm`.

Everything made is recorded in `lab.json` (with the shape) so `down()` removes exactly that.

Three labs can be up side by side (RAILYARD_LAB_INSTANCE=1: 198.19.*, `ryl1-A`, ...,
/var/tmp/railyard-lab1; RAILYARD_LAB_INSTANCE=2: 198.18.50.0/24 and rails 198.18.(150+k).0/24,
`ryl2-A`, ..., /var/tmp/railyard-lab2), which is how the test suite's workers each own one.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from railyard.errors import RailyardError, UsageError

LAB_DIR_ENV = "RAILYARD_LAB_DIR"
# Three labs can be up at once, side by side (the test suite's workers): instance 0, the default, is
# 198.18.*, its names rylab-*, its directory /var/tmp/railyard-lab; instance 1 is 198.19.*, ryl1-*,
# /var/tmp/railyard-lab1; instance 2 is 198.18.* again, its third octets 50 above instance 0's, ryl2-*,
# /var/tmp/railyard-lab2. Each lab's addresses: the management net `NET.(BASE).0/24`, rail k
# `NET.(BASE + 100 + k).0/24` (at most 8 rails: instance 0 and 2 do not meet).
LAB_INSTANCE_ENV = "RAILYARD_LAB_INSTANCE"
NETS = {0: ("198.18", 0), 1: ("198.19", 0), 2: ("198.18", 50)}   # instance -> (first two octets, third's base)
INSTANCES = tuple(NETS)


def _instance_problem() -> str | None:
    raw = os.environ.get(LAB_INSTANCE_ENV, "0") or "0"
    if raw in {str(i) for i in INSTANCES}:
        return None
    return f"{LAB_INSTANCE_ENV}={raw!r}: one of {', '.join(map(str, INSTANCES))} (198.18.0.0/15 holds three labs)"


def _instance() -> int:
    """This process's lab (lab.up refuses a value that is not one: _instance_problem)."""
    return 0 if _instance_problem() else int(os.environ.get(LAB_INSTANCE_ENV) or 0)


def stem(instance: int) -> str:
    """What the names of that lab's namespaces, links and bridges begin with."""
    return "rylab" if instance == 0 else f"ryl{instance}"


def default_lab_dir(instance: int) -> str:
    return "/var/tmp/railyard-lab" + ("" if instance == 0 else str(instance))


INSTANCE = _instance()
STEM = stem(INSTANCE)
NET, BASE = NETS[INSTANCE]    # the first two octets of every lab address, and where its third octets begin
DEFAULT_LAB_DIR = default_lab_dir(INSTANCE)
NS_PREFIX = f"{STEM}-"
MGMT_BRIDGE = f"{STEM}-mgmt"
MGMT_NET = f"{NET}.{BASE}"
CONTROL_IP = f"{MGMT_NET}.1"
RAIL_MTU = 9000
LAB_IMAGE_NAME = "vllm/vllm-openai:v0.30.0-aarch64"
LAB_IMAGE_DIGEST = "sha256:" + hashlib.sha256(b"railyard lab image v0.30.0-aarch64").hexdigest()
# a second tag of the same engine (what `inv roll --image` moves a lab deployment to)
LAB_IMAGE_NEXT = "vllm/vllm-openai:v0.32.0-aarch64"
LAB_IMAGE_NEXT_DIGEST = "sha256:" + hashlib.sha256(b"railyard lab image v0.32.0-aarch64").hexdigest()
# the LiteLLM proxy's own image (its program: the real proxy, from the lab's litellm venv)
LITELLM_IMAGE_NAME = "docker.litellm.ai/berriai/litellm:v1.108.7"
LITELLM_IMAGE_DIGEST = "sha256:" + hashlib.sha256(b"railyard lab image litellm v1.108.7").hexdigest()
# the vLLM router's image (its program: the real vllm-router, from the lab's vllm-router venv)
ROUTER_IMAGE_NAME = "ghcr.io/vllm-project/router:v0.1.17"
ROUTER_IMAGE_DIGEST = "sha256:" + hashlib.sha256(b"railyard lab image vllm-router v0.1.17").hexdigest()
_IMAGE_PATH = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
# each image's Config as `docker image inspect` shows it (railyard always passes --entrypoint)
LAB_IMAGES = {
    LAB_IMAGE_NAME: {"digest": LAB_IMAGE_DIGEST, "config": {
        "Env": _IMAGE_PATH, "Entrypoint": ["vllm", "serve"], "WorkingDir": "/vllm-workspace"}},
    LAB_IMAGE_NEXT: {"digest": LAB_IMAGE_NEXT_DIGEST, "config": {
        "Env": _IMAGE_PATH, "Entrypoint": ["vllm", "serve"], "WorkingDir": "/vllm-workspace"}},
    LITELLM_IMAGE_NAME: {"digest": LITELLM_IMAGE_DIGEST, "config": {
        "Env": _IMAGE_PATH, "Entrypoint": ["docker/prod_entrypoint.sh"], "Cmd": ["--port", "4000"],
        "WorkingDir": "/app"}},
    ROUTER_IMAGE_NAME: {"digest": ROUTER_IMAGE_DIGEST, "config": {
        "Env": _IMAGE_PATH, "Entrypoint": ["vllm-router"], "WorkingDir": "/app"}},
}
NCCL_LIB_TEXT = b"railyard lab stand-in for NCCL\0NCCL version 2.30.7+cuda13.0\0"
SIM_TOOLS = ("ibdev2netdev", "show_gids", "nvidia-smi", "lscpu", "timedatectl", "docker", "chronyc", "dmesg",
             "lsmod", "ibv_devinfo", "lspci", "ethtool")
HOST_TOOLS = ("vllm",)  # installed on the host itself (outside containers) where the shape says so
SIM_SOURCE = Path(__file__).parent / "sim" / "tools.py"
# perftest and ibstat stand-ins (sim/perftest.py): real TCP between the ends, figures from the rail
PERFTEST_TOOLS = ("ib_write_bw", "ib_write_lat", "ib_send_lat", "ibstat")
PERFTEST_SOURCE = Path(__file__).parent / "sim" / "perftest.py"
VLLM_SOURCE = Path(__file__).parent / "sim" / "vllm.py"
ENGINE_SOURCE = Path(__file__).parent / "sim" / "engine.py"  # the real engine inside the GPU layer
ENGINE_SITE_SOURCE = Path(__file__).parent / "sim" / "engine_site.py"  # the real engine's sitecustomize
ENGINES = ("vllm", "stand-in")
DEFAULT_ENGINE = "vllm"
MODEL_KINDS = ("dense", "moe")  # the lab's real models (tinymodel.py): dense for every layout, moe for dp_ep
MODEL_SEED = 0
# where a container sees a bind outside /tmp and /run (the checkpoint at /model, staged kernels at
# /kernels): a lab host's filesystem is this machine's, so lab.up makes the empty mount point, each
# container mounts over it in its own mount namespace, and lab.down removes what lab.up made
MOUNTPOINTS = ("/model", "/kernels")
LITELLM_SOURCE = Path(__file__).parent / "sim" / "litellm.py"
LMCACHE_CLIENT_SOURCE = Path(__file__).parent / "sim" / "lmcache_client.py"
NIXL_SOURCE = Path(__file__).parent / "sim" / "nixl.py"  # the stand-in's NixlConnector (image/lib/nixl_sim.py)
# what the lab image's `lmcache` runs with: LMCache's usage telemetry and banner off
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
SYSTEM_PYTHON = "/usr/bin/python3"
MAX_HOSTS = 200


# ---------------------------------------------------------------- shapes
# What one test host is. The simulated tools print nothing of their own: they read the host's
# `shape.json`, written from this data at up time (host_shape()).

def _rails(names: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    """(netdev, hca, subnet prefix) per rail: rail k is mlx5_k on 198.18.(100+k).0/24 (instance 0)."""
    return tuple((n, f"mlx5_{k}", rail_net(k)) for k, n in enumerate(names))


def rail_net(k: int) -> str:
    """The first three octets of rail k's addresses in this lab."""
    return f"{NET}.{BASE + 100 + k}"


def translate(text: str) -> str:
    """Text that names the default lab's addresses (198.18.T.x, as the runbook shows them) with this lab's."""
    return re.sub(r"\b198\.18\.(\d{1,3})\.", lambda m: f"{NET}.{BASE + int(m.group(1))}.", text)


# Sapphire Rapids (2 x 56 cores, 2 threads each): the NUMA layout and flags of the real dual-socket
# capture in tests/fixtures/real/lscpu/ (0-55,112-167 on node 0, 56-111,168-223 on node 1).
_SPR_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse "
              "sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good nopl "
              "xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq dtes64 monitor ds_cpl vmx smx est "
              "tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes "
              "xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb cat_l3 cat_l2 cdp_l3 invpcid_single "
              "intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow vnmi flexpriority ept vpid ept_ad "
              "fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a avx512f avx512dq rdseed adx smap "
              "avx512ifma clflushopt clwb intel_pt avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves "
              "cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 wbnoinvd "
              "dtherm ida arat pln pts avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq "
              "avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect cldemote movdiri movdir64b "
              "enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr amx_bf16 avx512_fp16 amx_tile amx_int8 "
              "flush_l1d arch_capabilities")
_GRACE_FLAGS = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc "
                "dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 "
                "sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh bti")
_NOT_AFFECTED = ("Gather data sampling", "Itlb multihit", "L1tf", "Mds", "Meltdown", "Mmio stale data", "Retbleed",
                 "Spec rstack overflow")

# CPUs: `lscpu` rows before the NUMA lines, the NUMA nodes (CPU list per node), the rows after
CPUS = {
    "grace": {
        "head": (("Architecture:", "aarch64"), ("CPU op-mode(s):", "64-bit"), ("Byte Order:", "Little Endian"),
                 ("CPU(s):", "72"), ("On-line CPU(s) list:", "0-71"), ("Vendor ID:", "ARM"),
                 ("Model name:", "Neoverse-V2"), ("Model:", "0"), ("Thread(s) per core:", "1"),
                 ("Core(s) per socket:", "72"), ("Socket(s):", "1"), ("Stepping:", "r0p0"),
                 ("Frequency boost:", "disabled"), ("CPU max MHz:", "3474.0000"), ("CPU min MHz:", "81.0000"),
                 ("BogoMIPS:", "2000.00"), ("Flags:", _GRACE_FLAGS), ("L1d cache:", "4.5 MiB (72 instances)"),
                 ("L1i cache:", "4.5 MiB (72 instances)"), ("L2 cache:", "72 MiB (72 instances)"),
                 ("L3 cache:", "114 MiB (1 instance)")),
        "numa": ("0-71",),
        "tail": tuple((f"Vulnerability {v}:", "Not affected") for v in _NOT_AFFECTED) + (
            ("Vulnerability Spec store bypass:", "Mitigation; Speculative Store Bypass disabled via prctl"),
            ("Vulnerability Spectre v1:", "Mitigation; __user pointer sanitization"),
            ("Vulnerability Spectre v2:", "Not affected"), ("Vulnerability Srbds:", "Not affected"),
            ("Vulnerability Tsx async abort:", "Not affected")),
    },
    "sapphire-rapids-2s": {
        "head": (("Architecture:", "x86_64"), ("CPU op-mode(s):", "32-bit, 64-bit"),
                 ("Address sizes:", "46 bits physical, 57 bits virtual"), ("Byte Order:", "Little Endian"),
                 ("CPU(s):", "224"), ("On-line CPU(s) list:", "0-223"), ("Vendor ID:", "GenuineIntel"),
                 ("Model name:", "Intel(R) Xeon(R) Platinum 8480+"), ("CPU family:", "6"), ("Model:", "143"),
                 ("Thread(s) per core:", "2"), ("Core(s) per socket:", "56"), ("Socket(s):", "2"),
                 ("Stepping:", "8"), ("Frequency boost:", "enabled"), ("CPU max MHz:", "3800.0000"),
                 ("CPU min MHz:", "800.0000"), ("BogoMIPS:", "4000.00"), ("Flags:", _SPR_FLAGS),
                 ("Virtualization:", "VT-x"), ("L1d cache:", "5.3 MiB (112 instances)"),
                 ("L1i cache:", "3.5 MiB (112 instances)"), ("L2 cache:", "224 MiB (112 instances)"),
                 ("L3 cache:", "210 MiB (2 instances)")),
        "numa": ("0-55,112-167", "56-111,168-223"),
        "tail": tuple((f"Vulnerability {v}:", "Not affected") for v in _NOT_AFFECTED) + (
            ("Vulnerability Spec store bypass:", "Mitigation; Speculative Store Bypass disabled via prctl and seccomp"),
            ("Vulnerability Spectre v1:", "Mitigation; usercopy/swapgs barriers and __user pointer sanitization"),
            ("Vulnerability Spectre v2:", "Mitigation; Enhanced IBRS, IBPB conditional, RSB filling, PBRSB-eIBRS SW sequence"),
            ("Vulnerability Srbds:", "Not affected"), ("Vulnerability Tsx async abort:", "Not affected")),
    },
}

# GPU models of an hgx8 host: nvidia-smi's name, memory.total (MiB) and power limit. H200: the real
# capture in tests/fixtures/real/nvidia-smi-h200/; B200: tests/fixtures/real/nvidia-smi-hgx/ (ORIGINS there).
GPU_MODELS = {
    "H200": {"name": "NVIDIA H200", "total": 143771, "power": "%3dW /  700W", "idle_w": 76},
    "B200": {"name": "NVIDIA B200", "total": 183359, "power": "%3dW / 1000W", "idle_w": 142},
}
# An HGX baseboard's GPUs on PCIe (a real 8 x H200 capture, tests/fixtures/real/nvidia-smi-hgx/): 0-3 under
# socket 0, 4-7 under socket 1; each rail NIC sits on the PCIe switch of its GPU, one bus number below it.
HGX_GPU_BUSES = (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)

# The rail NICs, as perftest and ibstat stand-ins read them (sim/perftest.py). rate_gbps: the port's negotiated
# rate (sysfs `rate`, ibstat `Rate:`): a DGX Station's ConnectX-8 rails at 400G (the README's two stations joined
# by 400G ConnectX-8 RoCE rails), an HGX H200/B200 server's ConnectX-7 at 400G NDR (NVIDIA's DGX H200/B200
# compute fabric: eight ConnectX-7 400 Gb/s OSFP ports). eff/eff_1qp: the share of that rate a healthy link moves
# in host memory with several QPs / one QP at 1 MiB: about 0.95 with -q 4 (field notes: host memory reads ~0.95,
# Azure asks 360 of 400 even in GPU memory); one QP on a Station reads 55-58 % (NVIDIA's two-Station playbook,
# "functional, below line rate"), one QP on a ConnectX-7 NDR port 392.34 of 400 Gb/s (the csegpu capture in
# tests/fixtures/real/perftest/). lat_us: a healthy 2-byte write latency (spark-vllm-docker's capture: 1.47 us).
NIC_MODELS = {
    "ConnectX-8": {"model": "ConnectX-8", "rate_gbps": 400, "eff": 0.95, "eff_1qp": 0.57, "lat_us": 1.47,
                   "fw": "40.45.1200", "part_id": 4131},
    "ConnectX-7": {"model": "ConnectX-7", "rate_gbps": 400, "eff": 0.96, "eff_1qp": 0.98, "lat_us": 1.47,
                   "fw": "28.45.4028", "part_id": 4129},
}

SHAPES = {
    "station": {
        "rails": _rails(("cx8r0", "cx8r1")), "serve_rail": "cx8r1", "gpu_name": "GB300", "cpu": "grace",
        "nvlink": None, "host_tools": (), "arch": "arm64",
    },
    "hgx8": {
        "rails": _rails(tuple(f"enp{b - 1}s0np0" for b in HGX_GPU_BUSES)), "serve_rail": "enp24s0np0",
        "gpu_name": None, "cpu": "sapphire-rapids-2s", "nvlink": "NV18", "host_tools": HOST_TOOLS, "arch": "amd64",
    },
}
DEFAULT_SHAPE = "station"


def _uuid(seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def check_shape(shape: str, gpu: str) -> None:
    if shape not in SHAPES:
        raise UsageError(f"--shape {shape}: one of {', '.join(SHAPES)}")
    if gpu not in GPU_MODELS:
        raise UsageError(f"--gpu {gpu}: one of {', '.join(GPU_MODELS)}")


def gpu_model_of(shape: str, gpu: str) -> str:
    """The GPU model a host of this shape serves on (its cluster_gpu_name)."""
    return SHAPES[shape]["gpu_name"] or gpu


def host_shape(shape: str, gpu: str, host: str) -> dict:
    """Everything the simulated tools of one host print about its hardware: its shape.json."""
    sh_ = SHAPES[shape]
    rails = sh_["rails"]
    if shape == "station":
        gpus = [
            {"name": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "short": "NVIDIA RTX PRO 6000 Blac...",
             "uuid": _uuid(host + "display"), "bus": "00000000:01:00.0", "total": 97887, "base": 12,
             "procs": [[2191, "G", "/usr/lib/xorg/Xorg", 4], [5635, "G", "/usr/bin/gnome-shell", 8]],
             "power": " 38W /  600W", "fan": "30%", "ecc": "Off", "persist": "Off", "display": True, "numa": 0},
            {"name": "NVIDIA GB300", "short": "NVIDIA GB300", "uuid": _uuid(host + "gb300"),
             "bus": "00000008:06:00.0", "total": 284208, "base": 1, "procs": [],
             "power": "237W / 1400W", "fan": "N/A", "ecc": "0", "persist": "On", "display": False, "numa": 0},
        ]
        nics = [{"hca": hca, "numa": 0, "near_gpu": None, **NIC_MODELS["ConnectX-8"]} for _, hca, _ in rails]
    else:
        m = GPU_MODELS[gpu]
        gpus = [{"name": m["name"], "short": m["name"], "uuid": _uuid(f"{host}{gpu}{i}"),
                 "bus": f"00000000:{b:02X}:00.0", "total": m["total"], "base": 0, "procs": [],
                 "power": m["power"] % (m["idle_w"] + (i * 7) % 5 - 2), "fan": "N/A", "ecc": "0", "persist": "On",
                 "display": False, "numa": 0 if i < 4 else 1} for i, b in enumerate(HGX_GPU_BUSES)]
        nics = [{"hca": hca, "numa": 0 if k < 4 else 1, "near_gpu": k, **NIC_MODELS["ConnectX-7"]}
                for k, (_, hca, _) in enumerate(rails)]
    cpu = CPUS[sh_["cpu"]]
    return {"shape": shape, "gpu_model": gpu_model_of(shape, gpu), "hcas": {hca: n for n, hca, _ in rails},
            "serve_rail": sh_["serve_rail"], "gpus": gpus, "nics": nics, "nvlink": sh_["nvlink"],
            "lscpu": {"head": cpu["head"], "numa": cpu["numa"], "tail": cpu["tail"]},
            "host_tools": list(sh_["host_tools"]), "arch": sh_["arch"]}


class LabError(RailyardError):
    """The lab could not be built or changed; the message says what to install or fix."""


def lab_dir(path: str | None = None) -> Path:
    return Path(path or os.environ.get(LAB_DIR_ENV) or DEFAULT_LAB_DIR)


def host_names(n: int) -> list[str]:
    """A, B, ... Z, then H27, H28, ..."""
    letters = list(string.ascii_uppercase)
    return [letters[i] if i < 26 else f"H{i + 1}" for i in range(n)]


@dataclass(frozen=True)
class LabHost:
    name: str
    index: int
    root: Path  # the lab directory
    shape: str = DEFAULT_SHAPE

    @property
    def ns(self) -> str:
        return NS_PREFIX + self.name

    @property
    def dir(self) -> Path:
        return self.root / "hosts" / self.name

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def bin(self) -> Path:
        return self.dir / "bin"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def mgmt_ip(self) -> str:
        return f"{MGMT_NET}.{10 + self.index}"

    @property
    def rails(self) -> tuple[tuple[str, str, str], ...]:
        """(netdev, hca, subnet prefix) of each rail of this host's shape."""
        return SHAPES[self.shape]["rails"]

    @property
    def serve_rail(self) -> str:
        return SHAPES[self.shape]["serve_rail"]

    def _rail_index(self, rail: str) -> int:
        for k, (name, _, _) in enumerate(self.rails):
            if name == rail:
                return k
        raise UsageError(f"lab: host {self.name} ({self.shape}) has no rail {rail!r}")

    def rail_ip(self, rail: str) -> str:
        return f"{self.rails[self._rail_index(rail)][2]}.{10 + self.index}"

    def veth(self, kind: str) -> str:
        """Root-namespace end of this host's veth for mgmt or a rail (<= 15 chars): rylab1m, rylab1r0, ...
        (instance 1: ryl1x1m, ryl1x1r0, ...)"""
        base = STEM + ("x" if INSTANCE else "") + str(self.index)
        return f"{base}m" if kind == "mgmt" else f"{base}r{self._rail_index(kind)}"

    @property
    def shape_file(self) -> Path:
        return self.dir / "shape.json"

    @property
    def anchor_pid_file(self) -> Path:
        return self.dir / "anchor.pid"

    @property
    def sshd_pid_file(self) -> Path:
        return self.dir / "sshd.pid"

    @property
    def sshd_config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def sshd_log(self) -> Path:
        """sshd's own log (its errors: LogLevel ERROR), where a failed test's report reads its last lines."""
        return self.dir / "sshd.log"

    @property
    def hosts_file(self) -> Path:
        """The host's /etc/hosts (bind-mounted over it in the host's mount namespace)."""
        return self.dir / "etc-hosts"

    @property
    def host_key(self) -> Path:
        return self.dir / "ssh_host_ed25519_key"


# ---------------------------------------------------------------- helpers

def sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Run a local command (argv, no shell). Raise LabError with its stderr on failure."""
    p = subprocess.run(list(argv), input=input, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise LabError(f"lab: `{' '.join(argv)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _requirements() -> None:
    if os.geteuid() != 0:
        raise LabError("lab: needs root (network namespaces, bridges and sshd)")
    missing = [t for t in ("ip", "unshare", "nsenter", "ssh-keygen", "ethtool", "ping", "rsync", "curl", "gcc")
               if shutil.which(t) is None]
    if not Path("/usr/sbin/sshd").exists():
        missing.append("sshd")
    if not Path(SYSTEM_PYTHON).exists():
        missing.append(SYSTEM_PYTHON)
    if missing:
        raise LabError(f"lab: missing {', '.join(missing)}: apt-get install openssh-server openssh-client "
                       "rsync iproute2 iputils-ping ethtool util-linux procps python3 faketime curl gcc libc6-dev")


def _link_exists(name: str, ns: str | None = None) -> bool:
    argv = ["ip"] + (["-n", ns] if ns else []) + ["link", "show", "dev", name]
    return sh(*argv, check=False).returncode == 0


def _ns_exists(ns: str) -> bool:
    return Path("/run/netns", ns).exists()


# ---------------------------------------------------------------- state file

def _load_state(root: Path) -> dict | None:
    try:
        return json.loads((root / "lab.json").read_text())
    except (OSError, ValueError):
        return None


def _save_state(root: Path, state: dict) -> None:
    tmp = root / "lab.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(root / "lab.json")


def hosts_of(root: Path) -> list[LabHost]:
    state = _load_state(root)
    if not state:
        raise UsageError(f"no lab at {root}: run `inv lab.up` first")
    return [LabHost(n, i + 1, root, state.get("shape", DEFAULT_SHAPE)) for i, n in enumerate(state["hosts"])]


def rail_bridge(k: int) -> str:
    return f"{STEM}-r{k}"


def bridges_of(shape: str) -> dict[str, str]:
    """kind (mgmt or rail netdev) -> bridge name."""
    return {"mgmt": MGMT_BRIDGE, **{name: rail_bridge(k) for k, (name, _, _) in enumerate(SHAPES[shape]["rails"])}}


def lab_host(root: Path, name: str) -> LabHost:
    for h in hosts_of(root):
        if h.name == name:
            return h
    raise UsageError(f"lab: no host {name!r} (hosts: {', '.join(h.name for h in hosts_of(root))})")


# ---------------------------------------------------------------- up / down

def up(n: int | None = None, path: str | None = None, log=print, shape: str | None = None, gpu: str = "H200",
       slurm: bool = False, engine: str | None = None, layout: str | None = None) -> Path:
    """Bring up N hosts of one shape (idempotent) and return the lab inventory's path. `gpu` is the
    GPU model of an hgx8 host (H200 or B200); a station always has its GB300. Another size or shape
    rebuilds the lab; another GPU model only rewrites what the hosts' tools report. slurm: a Slurm
    cluster over the hosts too (railyard_lab.slurm; clients need SLURM_CONF=<lab>/slurm/slurm.conf).
    engine: what the lab image's `vllm` is, `vllm` (the real engine, CPU build) or `stand-in`; None
    keeps the lab's (the real engine on a new lab). Containers already running keep theirs.
    layout: write the inventory for that serve_layout, on the hosts it needs (LAYOUTS); None: the
    shape's own (two stations: multinode_tp; hgx8 hosts: single_node_tp)."""
    if layout is not None:
        shape, n = check_layout(layout, shape, n)
    shape = shape or DEFAULT_SHAPE
    n = 2 if n is None else n
    if not 1 <= n <= MAX_HOSTS:
        raise UsageError(f"--hosts {n}: must be between 1 and {MAX_HOSTS}")
    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--engine {engine}: one of {', '.join(ENGINES)}")
    check_shape(shape, gpu)
    problem = _instance_problem()
    if problem:
        raise UsageError(problem)
    _requirements()
    root = lab_dir(path)
    state = _load_state(root)
    engine = engine or (state or {}).get("engine") or DEFAULT_ENGINE  # kept across a resize or another shape
    if state and len(state["hosts"]) != n:
        log(f"lab: resizing from {len(state['hosts'])} to {n} hosts")
        down(path, log=lambda *_: None)
        state = None
    if state and state.get("shape", DEFAULT_SHAPE) != shape:
        log(f"lab: rebuilding from {state.get('shape', DEFAULT_SHAPE)} to {shape} hosts")
        down(path, log=lambda *_: None)
        state = None
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    names = host_names(n)
    state = state or {"hosts": names, "bridges": list(bridges_of(shape).values()), "created": time.time()}
    state["shape"], state["gpu"] = shape, gpu_model_of(shape, gpu)
    state["engine"] = engine
    state["layout"] = layout or SHAPE_LAYOUT[shape]
    hosts = [LabHost(name, i + 1, root, shape) for i, name in enumerate(names)]

    from . import components
    components.ensure_all(log)  # the real vLLM, LMCache, LiteLLM and vllm-router (minutes the first time, then instant)
    for kind in MODEL_KINDS:
        components.model(kind, MODEL_SEED, log)
    _ensure_mountpoints(state)
    _save_state(root, state)
    _sweep_shm()
    _ensure_keys(root, hosts)
    _install_sims(root, hosts, gpu, state["engine"])
    _ensure_bridges(shape)
    for h in hosts:
        _ensure_host_net(h)
        _ensure_anchor(h)
        _sweep_shm(Path(f"/proc/{anchor_pid(h)}/root/dev/shm"))  # the host's own /dev/shm
    _write_known_hosts(root, hosts)
    procs = [_start_sshd(h) for h in hosts]
    _wait_sshd(hosts, procs)
    inv = _write_inventory(root, hosts, gpu, state["engine"], state["layout"])
    if slurm:
        from . import slurm as slurm_lab
        gpus = {h.name: sum(not g["display"] for g in host_shape(shape, gpu, h.name)["gpus"]) for h in hosts}
        slurm_lab.up(root, hosts, gpus, CONTROL_IP, session_env,
                     lambda h: ["nsenter", "-t", str(anchor_pid(h)), "-n", "-m", "-u", "--"])
        log(f"lab: Slurm up: {len(hosts)} idle nodes; SLURM_CONF={slurm_lab.conf_path(root)}")
    return inv


def _ensure_mountpoints(state: dict) -> None:
    made = state.setdefault("mountpoints", [])
    for d in MOUNTPOINTS:
        if not os.path.exists(d):
            os.mkdir(d, 0o755)
            made.append(d)


_SHM_OF_PID = re.compile(r"^lmcache_kv_(\d+)_\d+$")  # LMCache's CPU KV segments: /lmcache_kv_<pid>_<n>


def _sweep_shm(shm: Path = Path("/dev/shm")) -> None:
    """Unlink the KV segments of LMCache clients that are gone. On a CPU LMCache backs a replica's
    KV cache with POSIX shared memory (on GPUs: CUDA IPC, nothing to leak); a replica that was
    killed never unlinks its segments, and they would fill /dev/shm run after run."""
    try:
        names = os.listdir(shm)
    except OSError:
        return
    for name in names:
        m = _SHM_OF_PID.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.unlink(shm / name)
            except OSError:
                pass


def down(path: str | None = None, log=print) -> None:
    """Remove what up() made: processes, namespaces, links, bridges, files."""
    root = lab_dir(path)
    state = _load_state(root)
    if not state:
        log(f"lab: nothing at {root}")
        return
    hosts = [LabHost(n, i + 1, root, state.get("shape", DEFAULT_SHAPE)) for i, n in enumerate(state["hosts"])]
    from . import slurm as slurm_lab
    slurm_lab.down(root)  # its daemons first: slurmd would restart job steps on hosts going away
    for h in hosts:
        from . import faults
        for name in faults.RECORDED_PROCESSES:   # a fault's own process (a GPU holder, a crash loop's watcher)
            faults.kill_recorded(h, name)
        for pidfile in (h.sshd_pid_file, h.anchor_pid_file):
            pid = _read_pid(pidfile)
            if _pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        # sessions and anything else still running inside the host's namespace, and whatever those
        # sessions started in a network namespace of its own (a container without --network host)
        if _ns_exists(h.ns):
            pids = [int(p) for p in sh("ip", "netns", "pids", h.ns, check=False).stdout.split() if p.isdigit()]
            sessions = {_session_of(p) for p in pids} - {None, 0, 1, os.getsid(0)}
            for p in pids + [q for q in _all_pids() if _session_of(q) in sessions]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", h.ns, check=False)
        for kind in ["mgmt"] + [name for name, _, _ in h.rails]:
            if _link_exists(h.veth(kind)):
                sh("ip", "link", "del", h.veth(kind), check=False)
    for br in state.get("bridges", []):
        if _link_exists(br):
            sh("ip", "link", "del", br, check=False)
    shutil.rmtree(root, ignore_errors=True)
    mountpoints = state.get("mountpoints", [])
    other = next((d for i in INSTANCES if i != INSTANCE and _load_state(d := Path(default_lab_dir(i)))), None)
    if other is not None and mountpoints:  # the other lab's containers mount over them: it removes them
        theirs = _load_state(other) or {}
        theirs["mountpoints"] = sorted(set(theirs.get("mountpoints", [])) | set(mountpoints))
        _save_state(other, theirs)
        mountpoints = []
    for d in mountpoints:
        try:
            os.rmdir(d)  # only the empty mount point lab.up made
        except OSError:
            pass
    _sweep_shm()
    log(f"lab: removed {len(hosts)} hosts and {root}")


def _ensure_keys(root: Path, hosts: list[LabHost]) -> None:
    if not (root / "id_ed25519").exists():
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "railyard-lab-control", "-f", str(root / "id_ed25519"))
    for h in hosts:
        # docker's own state directories exist on a host with a daemon, before any container ran
        for d in (h.home / ".ssh", h.bin, h.state, h.dir / "docker" / "containers", h.dir / "docker" / "removed"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(h.home / ".ssh", 0o700)
        if not h.host_key.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"host-{h.name}", "-f", str(h.host_key))
        user_key = h.home / ".ssh" / "id_ed25519"
        if not user_key.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{h.name}", "-f", str(user_key))
    control_pub = (root / "id_ed25519.pub").read_text().strip()
    peer_pubs = [(h.home / ".ssh" / "id_ed25519.pub").read_text().strip() for h in hosts]
    for h in hosts:
        ak = h.home / ".ssh" / "authorized_keys"
        ak.write_text("\n".join([control_pub] + peer_pubs) + "\n")
        os.chmod(ak, 0o600)
        profile = h.home / ".profile"
        if not profile.exists():
            # login shells (inv lab.ssh) reset PATH in /etc/profile; put the host's tools back first
            profile.write_text(f'PATH="{h.bin}:$PATH"\n')


def _install_compiled(source: Path, program: Path) -> None:
    """A stand-in as a program that runs `source` compiled once, here, by the hosts' Python: a script's code is
    never cached, and compiling 1,600 lines took a third of each of the ~20 stand-in calls of a host's preflight.
    The code runs in the program's own `__main__`, as if the program were the source."""
    code = program.with_suffix(".code")
    sh(SYSTEM_PYTHON, "-SI", "-c", "import marshal, sys; src = open(sys.argv[1]).read(); "
       "open(sys.argv[2], 'wb').write(marshal.dumps(compile(src, sys.argv[1], 'exec')))", str(source), str(code))
    program.write_text(f"#!{SYSTEM_PYTHON} -SI\nimport marshal\n"
                       f"with open({str(code)!r}, 'rb') as f:\n    code = marshal.load(f)\nexec(code)\n")
    os.chmod(program, 0o755)


def _install_sims(root: Path, hosts: list[LabHost], gpu: str = "H200", engine: str = "vllm") -> None:
    sim = root / "sim" / "tools.py"
    sim.parent.mkdir(exist_ok=True)
    _install_compiled(SIM_SOURCE, sim)
    # the pinned image's content, as far as the lab's containers need it: `vllm` and nvidia.nccl
    image = root / "sim" / "image"
    (image / "bin").mkdir(parents=True, exist_ok=True)
    (image / "lib").mkdir(exist_ok=True)
    # the image's `vllm`: the real engine with the lab's GPU layer around it (sim/engine.py), or the
    # stand-in (sim/vllm.py), which also provides that GPU layer and the NCCL probe's stand-in
    standin = image / "lib" / "vllm_standin.py"
    standin.write_text(f"#!{SYSTEM_PYTHON} -SI\n" + VLLM_SOURCE.read_text().split("\n", 1)[1])
    chosen = ENGINE_SOURCE if engine == "vllm" else VLLM_SOURCE
    tmp = image / "bin" / ".vllm.new"
    tmp.write_text(f"#!{SYSTEM_PYTHON} -SI\n" + chosen.read_text().split("\n", 1)[1])
    os.chmod(tmp, 0o755)
    tmp.replace(image / "bin" / "vllm")
    # the image's python3: real, except for railyard's NCCL probe, which needs a GPU and PyTorch
    (image / "bin" / "python3").write_text(
        "#!/bin/sh\ncase \"$1\" in */nccl_probe.py) shift; exec " + SYSTEM_PYTHON + " -SI \"$(dirname \"$0\")/../lib/"
        "vllm_standin.py\" --railyard-probe \"$@\";; esac\nexec " + SYSTEM_PYTHON + " \"$@\"\n")
    os.chmod(image / "bin" / "python3", 0o755)
    nccl = image / "site" / "nvidia" / "nccl"
    (nccl / "lib").mkdir(parents=True, exist_ok=True)
    (nccl / "__init__.py").write_text("")
    # as a real build carries it: NCCL's VERSION_STRING, NUL-terminated (what preflight's nccl_lib reads)
    (nccl / "lib" / "libnccl.so.2").write_bytes(NCCL_LIB_TEXT)
    # the real LMCache server and LiteLLM proxy (components.py's venvs), as the images' programs
    from . import components
    lmc = components.program("lmcache")
    exports = " ".join(f"{k}={v}" for k, v in LMCACHE_ENV.items())
    (image / "bin" / "lmcache").write_text(f"#!/bin/sh\nexport {exports}\nunset PYTHONPATH\nexec {lmc} \"$@\"\n")
    os.chmod(image / "bin" / "lmcache", 0o755)
    ltext = LITELLM_SOURCE.read_text().replace("@LITELLM@", str(components.program("litellm")))
    (image / "bin" / "litellm").write_text(f"#!{SYSTEM_PYTHON} -SI\n" + ltext.split("\n", 1)[1])
    os.chmod(image / "bin" / "litellm", 0o755)
    (image / "lib" / "lmcache_client.py").write_text(LMCACHE_CLIENT_SOURCE.read_text())
    (image / "lib" / "nixl_sim.py").write_text(NIXL_SOURCE.read_text())
    (image / "engine-site").mkdir(exist_ok=True)
    (image / "engine-site" / "sitecustomize.py").write_text(ENGINE_SITE_SOURCE.read_text())
    # the real vLLM router (the router image's program); its own venv, nothing of the image's site dir
    (image / "bin" / "vllm-router").write_text(
        f"#!/bin/sh\nunset PYTHONPATH\nexec {components.program('vllm-router')} \"$@\"\n")
    os.chmod(image / "bin" / "vllm-router", 0o755)
    perftest = root / "sim" / "perftest.py"
    tmp = perftest.with_suffix(".new")
    tmp.write_text(f"#!{SYSTEM_PYTHON} -SI\n" + PERFTEST_SOURCE.read_text().split("\n", 1)[1])
    os.chmod(tmp, 0o755)
    tmp.replace(perftest)
    _build_memlock_shim(root / "sim")
    config = {"lab_dir": str(root), "image": LAB_IMAGE_NAME, "image_digest": LAB_IMAGE_DIGEST,
              "images": {name: i["config"] for name, i in LAB_IMAGES.items()},
              "lmcache_python": str(components.venv("vllm") / "bin" / "python"),  # LMCache's client library
              "engine": engine, "engine_vllm": str(components.program("vllm"))}
    (root / "sim" / "lab.json").write_text(json.dumps(config))
    for h in hosts:
        removed = set(json.loads((h.state / "missing-tools.json").read_text())) \
            if (h.state / "missing-tools.json").exists() else set()
        for tool in SIM_TOOLS:
            link = h.bin / tool
            if tool in removed:
                continue
            if not link.is_symlink():
                link.symlink_to(sim)
        for tool in PERFTEST_TOOLS:
            link = h.bin / tool
            if tool not in removed and not link.is_symlink():
                link.symlink_to(perftest)
        for tool in SHAPES[h.shape]["host_tools"]:  # e.g. a host-level vLLM (the image's stand-in)
            link = h.bin / tool
            if not link.is_symlink():
                link.symlink_to(image / "bin" / tool)
        images = h.dir / "docker" / "images.json"
        if not images.exists():
            images.write_text(json.dumps({name: i["digest"] for name, i in LAB_IMAGES.items()}))
        elif not images.with_suffix(".json.orig").exists():  # no fault holds it: add images new since
            have = json.loads(images.read_text())
            if any(name not in have for name in LAB_IMAGES):
                images.write_text(json.dumps({**{n: i["digest"] for n, i in LAB_IMAGES.items()}, **have}))
        tmp = h.shape_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(host_shape(h.shape, gpu, h.name), indent=1))
        tmp.replace(h.shape_file)


def _build_memlock_shim(sim: Path) -> None:
    """Containers ask for `--ulimit memlock=-1`; raising it needs CAP_SYS_RESOURCE, which a sandboxed
    lab may not have. Where the real limit cannot be set, the container's processes see the limit it
    was given through this small preload library (as libfaketime shows a shifted clock)."""
    out = sim / "memlock.so"
    src = Path(__file__).parent / "sim" / "memlock.c"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return
    if shutil.which("gcc") is None:
        raise LabError("lab: needs gcc to build its memlock shim: apt-get install gcc libc6-dev")
    sh("gcc", "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-ldl")


def _ensure_bridges(shape: str) -> None:
    for kind, br in bridges_of(shape).items():
        if not _link_exists(br):
            sh("ip", "link", "add", br, "type", "bridge")
        if kind != "mgmt":
            sh("ip", "link", "set", br, "mtu", str(RAIL_MTU))
        sh("ip", "link", "set", br, "up")
    addrs = sh("ip", "-br", "-4", "addr", "show", "dev", MGMT_BRIDGE).stdout
    if f"{CONTROL_IP}/24" not in addrs:
        sh("ip", "addr", "add", f"{CONTROL_IP}/24", "dev", MGMT_BRIDGE)


def _ensure_host_net(h: LabHost) -> None:
    if not _ns_exists(h.ns):
        sh("ip", "netns", "add", h.ns)
    sh("ip", "-n", h.ns, "link", "set", "lo", "up")
    inside = {"mgmt": "mgmt0", **{name: name for name, _, _ in h.rails}}
    bridges = bridges_of(h.shape)
    for kind, name in inside.items():
        if not _link_exists(name, h.ns):
            if _link_exists(h.veth(kind)):
                sh("ip", "link", "del", h.veth(kind))
            sh("ip", "link", "add", h.veth(kind), "type", "veth", "peer", "name", name, "netns", h.ns)
        mtu = "1500" if kind == "mgmt" else str(RAIL_MTU)
        sh("ip", "link", "set", h.veth(kind), "master", bridges[kind], "mtu", mtu, "up")
        ip = h.mgmt_ip if kind == "mgmt" else h.rail_ip(kind)
        have = sh("ip", "-n", h.ns, "-br", "-4", "addr", "show", "dev", name).stdout
        if f"{ip}/24" not in have:
            sh("ip", "-n", h.ns, "addr", "add", f"{ip}/24", "dev", name)
        sh("ip", "-n", h.ns, "link", "set", name, "mtu", mtu, "up")
    # as systemd's sysctl defaults set it on real hosts (50-default.conf): ping uses ICMP datagram sockets, whose
    # replies the kernel hands to the one socket that sent the echo. A fresh namespace has "1 0" (raw sockets only):
    # then each of preflight's 23 concurrent pings at 24 hosts receives every jumbo reply, and on 2 cores their
    # receive buffers overflowed (up to 50 of 552 peer pairs lost a frame, not on the real hosts' own NICs)
    sh("ip", "netns", "exec", h.ns, "sysctl", "-qw", "net.ipv4.ping_group_range=0 2147483647")


def _ensure_anchor(h: LabHost) -> None:
    """A process that holds the host's private mount + UTS namespace (home over /root, hostname, and
    a /dev/shm of its own: processes of two real hosts never share POSIX shared memory, and vLLM
    takes two ranks that see one segment for ranks of one node)."""
    if _pid_alive(_read_pid(h.anchor_pid_file)):
        return
    # the host's own /etc/hosts, as a real host's: its name resolves to its management address (what torch's
    # Gloo binds without GLOO_SOCKET_IFNAME); a fault rewrites it in place (gloo-loopback)
    h.hosts_file.write_text(hosts_file_text(h))
    script = (f"mount --bind {h.home} /root && mount --bind {h.hosts_file} /etc/hosts && hostname {h.name} && "
              f"mount -t tmpfs -o mode=1777,nosuid,nodev railyard-shm /dev/shm && "
              f"mkdir -p /run/sshd && exec sleep infinity")
    p = subprocess.Popen(["ip", "netns", "exec", h.ns, "unshare", "-m", "-u", "--propagation", "private",
                          "/bin/sh", "-c", script], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # the anchor is the pid of `sleep` after the execs; wait until it reached it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise LabError(f"lab: host {h.name}: namespace anchor failed: {p.stderr.read().decode().strip()}")
        try:
            exe = os.readlink(f"/proc/{p.pid}/exe")
        except OSError:
            exe = ""
        if exe.endswith("sleep"):
            h.anchor_pid_file.write_text(str(p.pid))
            return
        time.sleep(0.01)
    raise LabError(f"lab: host {h.name}: namespace anchor did not start")


def hosts_file_text(h: LabHost, own: str | None = None) -> str:
    """/etc/hosts of a lab host: localhost, then its own name at `own` (default: its management address)."""
    return (f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{own or h.mgmt_ip}\t{h.name}\n")


def anchor_pid(h: LabHost) -> int:
    pid = _read_pid(h.anchor_pid_file)
    if not _pid_alive(pid):
        raise LabError(f"lab: host {h.name} is not running (run `inv lab.up`)")
    return pid


def in_host(h: LabHost, *argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Run a command inside the host's namespaces (network, mount, hostname)."""
    return sh("nsenter", "-t", str(anchor_pid(h)), "-n", "-m", "-u", "--", *argv, check=check, input=input)


def session_env(h: LabHost) -> dict[str, str]:
    """What a session on the host gets (sshd's SetEnv; Slurm's task prolog): its tools first on PATH."""
    return {"PATH": f"{h.bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "RAILYARD_LAB_HOST_DIR": str(h.dir)}


def write_sshd_config(h: LabHost) -> None:
    env = session_env(h)
    skew = h.state / "clock-skew"
    if skew.exists():
        lib = _faketime_lib()
        env["LD_PRELOAD"] = lib
        env["FAKETIME"] = skew.read_text().strip()
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
    setenv = " ".join(f"{k}={v}" for k, v in env.items())
    h.sshd_config.write_text(f"""\
# railyard lab host {h.name}
Port 22
ListenAddress 0.0.0.0
HostKey {h.host_key}
PidFile {h.sshd_pid_file}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AuthorizedKeysFile .ssh/authorized_keys
MaxStartups 200:30:400
MaxSessions 64
PrintMotd no
LogLevel ERROR
SetEnv {setenv}
Subsystem sftp internal-sftp
""")


def _faketime_lib() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1") + glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    if not found:
        raise LabError("lab: clock-skew needs libfaketime: apt-get install faketime")
    return found[0]


def _start_sshd(h: LabHost) -> subprocess.Popen | None:
    if _pid_alive(_read_pid(h.sshd_pid_file)):
        return None
    write_sshd_config(h)
    return subprocess.Popen(["nsenter", "-t", str(anchor_pid(h)), "-n", "-m", "-u", "--",
                             "/usr/sbin/sshd", "-f", str(h.sshd_config), "-E", str(h.sshd_log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_sshd(h: LabHost) -> None:
    _wait_sshd([h], [_start_sshd(h)])


def _wait_sshd(hosts: list[LabHost], procs: list[subprocess.Popen | None]) -> None:
    for h, p in zip(hosts, procs):
        if p is not None and p.wait(timeout=20) != 0:
            said = p.stderr.read().decode().strip() or \
                (h.sshd_log.read_text(errors="replace").strip().splitlines() or [""])[-1]
            raise LabError(f"lab: sshd on {h.name} failed to start: {said}")
    deadline = time.monotonic() + 15
    for h in hosts:
        while True:
            try:
                with socket.create_connection((h.mgmt_ip, 22), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise LabError(f"lab: sshd on {h.name} ({h.mgmt_ip}:22) does not answer")
            time.sleep(0.05)


def stop_sshd(h: LabHost) -> None:
    pid = _read_pid(h.sshd_pid_file)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            if not _pid_alive(pid):
                break
            time.sleep(0.01)
    h.sshd_pid_file.unlink(missing_ok=True)


def restart_sshd(h: LabHost) -> None:
    stop_sshd(h)
    start_sshd(h)


def _pub(path: Path) -> str:
    kind, blob = path.read_text().split()[:2]
    return f"{kind} {blob}"


def _write_known_hosts(root: Path, hosts: list[LabHost]) -> None:
    """Control machine: mgmt addresses. Each host: every peer by mgmt and rail addresses."""
    lines = [f"{h.mgmt_ip} {_pub(h.host_key.with_suffix('.pub'))}" for h in hosts]
    (root / "known_hosts").write_text("\n".join(lines) + "\n")
    for h in hosts:
        entries = []
        for p in hosts:
            names = ",".join([p.mgmt_ip] + [p.rail_ip(r) for r, _, _ in p.rails])
            entries.append(f"{names} {_pub(p.host_key.with_suffix('.pub'))}")
        kh = h.home / ".ssh" / "known_hosts"
        if not kh.exists():  # a host-key-changed fault must not be silently healed here
            kh.write_text("\n".join(entries) + "\n")


# The lab checkpoint (checkpoint.py: the real tiny model, tinymodel.py) and how the real engine serves
# it. The role defaults are the GLM-5 reference on GPUs (the stand-in takes them); the real engine is
# vLLM's CPU build on a tiny dense Qwen3: no MTP head, no GLM tool or reasoning parser, no FP8 KV
# cache (this CPU has no AVX-512: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"), no CUDA
# graphs or kernels; --enforce-eager starts an engine in about 45 s instead of 60-105 s of
# torch.compile on 2 cores.
LAB_MODEL = {"model_repo": "railyard-lab/tiny-qwen3", "model_path": "~/models/tiny-qwen3", "model_size_gb": 1,
             "model_architectures": ["Qwen3ForCausalLM"], "model_quant_algo": ""}
LAB_SERVING = {"vllm_kv_cache_dtype": "auto", "vllm_max_model_len": 8192, "vllm_speculative_config": None,
               "vllm_tool_call_parser": None, "vllm_reasoning_parser": None, "vllm_kernel_config": None,
               "vllm_compilation_config": None, "vllm_block_size": None, "vllm_extra_args": ["--enforce-eager"],
               # the CPU build's KV cache: 1 GiB per engine worker (unset, each takes a share of the machine)
               "vllm_extra_env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
# the two stations' reference switches, less --enable-auto-tool-choice (it needs a tool-call parser)
STATION_FLAGS = ["--trust-remote-code", "--disable-custom-all-reduce", "--enable-prefix-caching",
                 "--enable-prompt-tokens-details"]
# What each layout needs of the lab (`inv lab.up --layout L`): its hosts and their shape
LAYOUTS = {"multinode_tp": ("station", 2), "single_node_tp": ("hgx8", 1), "dp_ep": ("hgx8", 1),
           "replicas": ("hgx8", 1), "pd": ("hgx8", 2)}
SHAPE_LAYOUT = {"station": "multinode_tp", "hgx8": "single_node_tp"}  # a shape's layout without --layout
# The real engine's share of an hgx8 host: 2 of its 8 GPUs (each GPU is an engine worker process on
# this machine's two cores: all 8 would be 8 workers and 16 GB). The stand-in takes the layouts'
# own sizes (8 GPUs).
REAL_HGX8 = {
    "single_node_tp": {"cluster_gpus_per_host": 2, "vllm_tensor_parallel_size": 2},
    "dp_ep": {"cluster_gpus_per_host": 2, "vllm_tensor_parallel_size": 1, "vllm_data_parallel_size": 2},
    "replicas": {"cluster_gpus_per_host": 2, "vllm_replicas": 2, "vllm_tensor_parallel_size": 1},
    # one prefill and one decode instance of one DP rank, on the dense model (no experts to spread,
    # no MTP head, no FlashInfer all2all); NIXL's KV buffer in host memory (no GPU memory), over
    # UCX's TCP transport on the serve rail (the lab has no RDMA device for rc_mlx5)
    "pd": {"cluster_gpus_per_host": 1, "vllm_enable_expert_parallel": False,
           "pd_prefill_defaults": {"vllm_data_parallel_size": 1, "vllm_speculative_config": None},
           "pd_decode_defaults": {"vllm_data_parallel_size": 1, "vllm_speculative_config": None,
                                  "vllm_all2all_backend": None, "vllm_compilation_config": None},
           "pd_kv_buffer_device": "cpu", "pd_ucx_tls": "tcp,self,sm", "pd_ucx_net_devices": SHAPES["hgx8"]["serve_rail"]},
}
# dp_ep needs experts: the lab's MoE model (tinymodel.py, kind moe)
MOE_MODEL = {"model_repo": "railyard-lab/tiny-qwen3-moe", "model_path": "~/models/tiny-qwen3-moe",
             "model_architectures": ["Qwen3MoeForCausalLM"]}


def model_kind(layout: str) -> str:
    return "moe" if layout == "dp_ep" else "dense"


def lab_model_path(layout: str) -> str:
    return (MOE_MODEL if layout == "dp_ep" else LAB_MODEL)["model_path"]


def lab_layout(root: Path) -> str:
    """The layout the lab's inventory was written for."""
    state = _load_state(root) or {}
    return state.get("layout") or SHAPE_LAYOUT[state.get("shape", DEFAULT_SHAPE)]


def lab_engine(root: Path) -> str | None:
    """What the lab image's `vllm` is (ENGINES), or None where no lab is up."""
    return (_load_state(root) or {}).get("engine")


def check_layout(layout: str, shape: str | None, n: int | None) -> tuple[str, int]:
    """The shape and host count of a lab for this layout (a larger --hosts for the multi-host ones)."""
    if layout not in LAYOUTS:
        raise UsageError(f"--layout {layout}: one of {', '.join(LAYOUTS)}")
    want_shape, want_n = LAYOUTS[layout]
    if shape not in (None, want_shape):
        raise UsageError(f"--layout {layout} runs on {want_shape} hosts, not --shape {shape}")
    if n is not None and (n < want_n or (want_n == 1 and n != 1)):
        raise UsageError(f"--layout {layout} needs {'exactly' if want_n == 1 else 'at least'} {want_n} host(s), "
                         f"not --hosts {n}")
    return want_shape, n or want_n


def _layout_vars(layout: str, engine: str, hosts: list[LabHost]) -> dict:
    if layout == "multinode_tp":  # a station serves on its one GB300, one rank per host
        return {"vllm_tensor_parallel_size": len(hosts), **({"vllm_flags": STATION_FLAGS} if engine == "vllm" else {})}
    out = {"serve_layout": layout, **(REAL_HGX8[layout] if engine == "vllm" else {})}
    if layout == "dp_ep":
        out.update(MOE_MODEL)
    if layout == "replicas" and engine == "vllm":
        # LMCache 0.5.6's server serves only GPU (lmcache-driven) transfers by default; the CPU
        # engine's connector asks for engine-driven ones: `auto` serves both
        out["lmcache_transfer_mode"] = "auto"
    return out


def _layout_groups(layout: str, hosts: list[LabHost]) -> dict:
    if layout == "multinode_tp":
        return {}
    if layout == "pd":  # the last host decodes, the others prefill; the proxy on the first
        return {"prefill": {"vars": {"pd_instances_per_host": 1}, "hosts": {h.name: None for h in hosts[:-1]}},
                "decode": {"vars": {"pd_instances_per_host": 1}, "hosts": {hosts[-1].name: None}}}
    return {"serve": {"hosts": {hosts[0].name: None}}}


def _write_inventory(root: Path, hosts: list[LabHost], gpu: str = "H200", engine: str = DEFAULT_ENGINE,
                     layout: str | None = None) -> Path:
    shape = hosts[0].shape
    layout = layout or SHAPE_LAYOUT[shape]
    inv = {
        "all": {
            "vars": {
                "ansible_user": "root",
                "ansible_ssh_private_key_file": "id_ed25519",
                "ssh_known_hosts": "known_hosts",
                "cluster_serve_rail": SHAPES[shape]["serve_rail"],
                "cluster_gpu_name": gpu_model_of(shape, gpu),
                **LAB_MODEL,
                "model_revision": hashlib.sha1(b"railyard lab checkpoint").hexdigest(),
                "vllm_image": f"{LAB_IMAGE_NAME}@{LAB_IMAGE_DIGEST}",
                # the real engine is the CPU build, served as a CPU serves; the stand-in stands in for the
                # GPU build and takes the reference's GPU flags
                **(LAB_SERVING if engine == "vllm" else {}),
                # serve_layout replicas on this machine: a small LMCache L1 (it allocates all of it at
                # start on a CPU), one LiteLLM worker (~380 MB each), a short health-check interval
                **({"litellm_image": f"{LITELLM_IMAGE_NAME}@{LITELLM_IMAGE_DIGEST}", "lmcache_l1_size_gb": 0.25,
                    "litellm_num_workers": 1, "litellm_health_check_interval_s": 5,
                    # serve_layout pd: the real vllm-router, polling its instances every 2 s
                    "pd_proxy_image": f"{ROUTER_IMAGE_NAME}@{ROUTER_IMAGE_DIGEST}", "pd_proxy_health_interval_s": 2,
                    "pd_proxy_health_failures": 1} if shape == "hgx8" else {}),
                # veth links report 10000Mb/s; real ConnectX-8 rails report 400000
                "preflight_link_speed_mbps": 10000,
                # the tests launch hundreds of times; the one that checks a launch's canary record sets it
                "canary_at_launch": False,
                "preflight_disk_margin_gb": 1,
                **_layout_vars(layout, engine, hosts),
            },
            "children": {
                "lab": {
                    "hosts": {
                        h.name: {
                            "ansible_host": h.mgmt_ip,
                            "rank": h.index - 1,
                            "rails": {r: {"hca": hca, "ipv4": f"{h.rail_ip(r)}/24"} for r, hca, _ in h.rails},
                        } for h in hosts
                    }
                },
                **_layout_groups(layout, hosts),
            },
        }
    }
    path = root / "inventory.yml"
    path.write_text(f"# Written by `inv lab.up`: the lab's test hosts, for serve_layout {layout} on the "
                    f"{'real vLLM' if engine == 'vllm' else 'stand-in'} engine. Regenerated on every lab.up.\n"
                    + yaml.safe_dump(inv, sort_keys=False))
    return path


def ssh_argv(root: Path, h: LabHost, command: list[str] | None = None) -> list[str]:
    """An OpenSSH command line into a lab host, host keys checked against the lab's known_hosts."""
    argv = ["ssh", "-i", str(root / "id_ed25519"), "-o", f"UserKnownHostsFile={root / 'known_hosts'}",
            "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            f"root@{h.mgmt_ip}"]
    if command:
        argv += ["--"] + command
    return argv
