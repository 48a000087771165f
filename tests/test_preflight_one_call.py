"""Preflight issue 15: one process per tool per host (one `docker image inspect` for both references, the compute
processes and the driver's CUDA version from one `nvidia-smi -q -d PIDS`), CUDA and image-NCCL parity.

Origins: tests/fixtures/real/nvidia-smi-one-call/ORIGINS.md (an H200 device machine), docker/ in
FORMATS-ORIGINS.md, nvidia-smi-hgx/ in FORMATS-ORIGINS.md."""

import json

from railyard.checks.docker import check_image
from railyard.checks.gpu import check_gpu
from railyard.checks.parity import check_parity
from railyard.facts.gpu import Gpu, compute_apps_csv, parse_compute_apps, parse_cuda_version, parse_smi_pids
from railyard.verbs.preflight import _apps_output, _versions
from railyard.facts.probe import Output

from .conftest import REAL
from .test_preflight_health import host

ONE = REAL / "nvidia-smi-one-call"
BUSY = (ONE / "h200-nvidia-smi-q-d-pids_busy.txt").read_text()
IDLE = (ONE / "h200-nvidia-smi-q-d-pids_idle.txt").read_text()
# what --query-gpu and --query-compute-apps printed in the same capture run (_capture-log.txt)
UUID = "GPU-1f5cdae7-f099-2552-b554-d4c00cfec2bb"
APPS_BUSY = f"{UUID}, 458, python3, 8710\n"


def test_nvidia_smi_takes_one_query_switch_per_call():
    text = (ONE / "h200-nvidia-smi-two-query-switches.txt").read_text()
    assert text.strip() == "Only one --query-* switch can be used at a time."


def test_q_d_pids_gives_the_cuda_version_and_the_compute_processes_of_query_compute_apps():
    busy = parse_smi_pids(BUSY)
    assert (busy.driver, busy.cuda, busy.gpus) == ("580.159.04", "13.0", ["00000000:00:06.0"])
    gpus = [Gpu(0, UUID, "NVIDIA H200", 8719, 143771)]
    assert parse_compute_apps(compute_apps_csv(busy, gpus)) == parse_compute_apps(APPS_BUSY)
    idle = parse_smi_pids(IDLE)
    assert idle.procs == [] and compute_apps_csv(idle, gpus) == ""  # as the idle compute-apps query: nothing
    # by bus id first (health rows), by position where no bus id is known
    other = compute_apps_csv(busy, [Gpu(0, "GPU-wrong", "x", 0, 0)], {UUID: "00000000:00:06.0"})
    assert other.startswith(UUID)


def test_the_gpu_check_reads_a_busy_gpu_from_q_d_pids_as_before():
    h = host(cluster_gpu_name="H200")
    base = f"0, {UUID}, NVIDIA H200, 8719, 143771\n"
    r = check_gpu(h, Output(0, base), _apps_output(Output(0, BUSY), Output(0, base), Output(1, "")))
    assert r.status == "fail" and "is busy: pid 458 python3 holds 8710 MiB" in r.detail
    ok = check_gpu(h, Output(0, base), _apps_output(Output(0, IDLE), Output(0, base), Output(1, "")))
    assert ok.status == "pass"
    # nvidia-smi -q failing is no pass: the processes were not listed
    bad = check_gpu(h, Output(0, base), _apps_output(Output(6, "No devices were found\n"), Output(0, base),
                                                       Output(1, "")))
    assert bad.status == "fail" and "cannot list compute processes" in bad.detail


def test_cuda_version_from_the_table_header_q_and_version_forms():
    assert parse_cuda_version((REAL / "nvidia-smi-hgx" / "web-nvidia-smi-570.124.06-8x-H200-idle-gpu-rows.txt")
                                .read_text()) == "12.8"
    assert parse_cuda_version((REAL / "nvidia-smi-h200" / "nvidia-smi-version_idle.txt").read_text()) == "13.0"
    assert parse_cuda_version((REAL / "gpu-health" / "h200-nvidia-smi-q.txt").read_text()) == "13.0"
    assert parse_cuda_version("CUDA Version: N/A") is None


def test_parity_names_a_rank_with_another_driver_cuda_version():
    hosts = [host(n) for n in "ABC"]
    seen = {n: {"driver": "580.105.08", "cuda": "13.0"} for n in "AB"} | {"C": {"driver": "570.124.06", "cuda": "12.8"}}
    res = check_parity(hosts, seen)
    assert res["A"].status == "pass" and "driver CUDA version 13.0" in res["A"].detail
    c = res["C"]
    assert c.status == "fail" and "driver CUDA version 12.8 (others: A 13.0, B 13.0, C 12.8)" in c.detail
    assert "the CUDA version nvidia-smi shows is the driver's" in c.hint


def test_parity_leaves_a_host_without_the_image_to_the_image_check():
    """The image's NCCL_VERSION is read from the pinned image: a host that lacks it fails the image check, and
    parity does not name that host a second time; two images with two NCCLs are still a difference."""
    hosts = [host(n) for n in "ABC"]
    seen = {n: {"driver": "580.105.08", "nccl": "2.27.7"} for n in "AB"} | {"C": {"driver": "580.105.08"}}
    res = check_parity(hosts, seen)
    assert all(r.status == "pass" for r in res.values()), res
    seen["B"]["nccl"] = "2.26.2"
    res = check_parity(hosts, seen)
    assert res["A"].status == res["B"].status == "fail" and res["C"].status == "pass"
    assert "image NCCL_VERSION 2.26.2 (others: A 2.27.7, B 2.26.2)" in res["B"].detail


DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
IMAGE = f"vllm/vllm-openai:v0.11.0@{DIGEST}"
MISSING = "Error response from daemon: No such image: {}"  # real wording: docker/web-docker-image-inspect-missing...


def inspect(*docs, missing=()):
    """`docker image inspect IMAGE TAG` as docker prints it: one JSON array of the refs found (stdout), then an
    error line per missing ref (stderr; the probe merges the two)."""
    arr = [{"Id": "sha256:" + d[7:19] * 5, "RepoTags": ["vllm/vllm-openai:v0.11.0"],
            "RepoDigests": [f"vllm/vllm-openai@{d}"], "Architecture": "arm64", "Os": "linux",
            "Config": {"Env": ["PATH=/usr/bin", f"NCCL_VERSION={nccl}"] if nccl else ["PATH=/usr/bin"]}}
           for d, nccl in docs]
    return Output(1 if missing else 0, json.dumps(arr, indent=4) + "\n" + "".join(MISSING.format(m) + "\n"
                                                                              for m in missing))


def test_one_inspect_for_the_pinned_ref_and_its_tag():
    h = host(vllm_image=IMAGE)
    both = check_image(h, inspect((DIGEST, None), (DIGEST, None)), True)
    assert both.status == "pass" and f"sha256:{'ab' * 6} present (arm64" in both.detail
    moved = check_image(h, inspect((OTHER, None), missing=[IMAGE]), True)  # the tag now names another build
    assert moved.status == "fail" and moved.detail == (f"pinned digest sha256:{'ab' * 6} not present; "
                                                       f"vllm/vllm-openai:v0.11.0 here is sha256:{'cd' * 6}")
    assert moved.evidence == MISSING.format(IMAGE) and moved.hint == f"docker pull {IMAGE}"
    none = check_image(h, inspect(missing=[IMAGE, "vllm/vllm-openai:v0.11.0"]), True)
    assert none.status == "fail" and none.detail == f"pinned digest sha256:{'ab' * 6} not present"
    assert "No such image: vllm/vllm-openai:v0.11.0" in none.evidence


def test_the_pinned_images_nccl_version_is_compared_where_the_image_sets_it():
    v = _versions({"image": inspect((OTHER, "2.26.2-1"), (DIGEST, "2.27.3-1"))}, DIGEST)
    assert v["nccl"] == "2.27.3-1"  # the pinned image's, not the tag's
    assert "nccl" not in _versions({"image": inspect((OTHER, "2.26.2-1"), missing=[IMAGE])}, DIGEST)
    assert _versions({"image": inspect((DIGEST, None))}, DIGEST)["nccl"] is None  # vllm/vllm-openai sets none
    res = check_parity([host("A"), host("B")], {"A": {"nccl": "2.27.3-1"}, "B": {"nccl": "2.26.2-1"}})
    assert res["B"].status == "fail" and "image NCCL_VERSION 2.26.2-1" in res["B"].detail
    assert "docker pull the pinned vllm_image" in res["B"].hint
    assert check_parity([host("A"), host("B")], {"A": {"nccl": None}, "B": {"nccl": None}})["A"].status == "warn"
