"""Docker checks: the daemon answers, the pinned image is present.
"""

from __future__ import annotations

from . import FAIL, PASS, SKIP, CheckResult, first_lines, unusable
from ..facts import ParseError
from ..facts.docker import parse_docker_version, parse_image_inspect
from ..facts.probe import Output
from ..inventory import Host


def check_docker(host: Host, out: Output) -> CheckResult:
    bad = unusable(host, "docker", out, "docker version")
    if bad:
        return bad
    v = parse_docker_version(out.text)
    if v.server:
        return CheckResult(host.name, "docker", PASS, f"daemon answers: server {v.server}, client {v.client}",
                           f"Server: Engine Version {v.server}")
    err = v.error or first_lines(out.text, 2)
    if "permission denied" in err:
        hint = "add the SSH user to the docker group (sudo usermod -aG docker $USER), then log in again"
    else:
        hint = "start the daemon: sudo systemctl start docker (journalctl -u docker says why it stopped)"
    return CheckResult(host.name, "docker", FAIL, "no Server section: the Docker daemon is unreachable",
                       err, hint)


def check_image(host: Host, out: Output, docker_ok: bool) -> CheckResult:
    """One `docker image inspect IMAGE TAG` (the pinned reference and its tag): the pinned digest must be among
    the images found; when it is not, the tag's image (if any) is named."""
    image = host.vars["vllm_image"]
    if not docker_ok:
        return CheckResult(host.name, "image", SKIP, "Docker daemon unreachable (see the docker check)")
    bad = unusable(host, "image", out, "docker image inspect")
    if bad:
        return bad
    want = image.split("@", 1)[1]
    try:
        found = parse_image_inspect(out.text)
    except ParseError:
        found = []
    img = next((i for i in found if want in i.digests()), None)
    if img is not None:
        return CheckResult(host.name, "image", PASS, f"{_short(want)} present ({img.architecture}, id {_short(img.id)})",
                           f"RepoDigests {' '.join(img.repo_digests)}")
    tag = image.split("@", 1)[0]
    other = ""
    if found:  # the pinned one is missing, so what was found is the tag's image
        other = f"; {tag} here is {', '.join(_short(d) for d in sorted(found[0].digests())) or 'an unpinned build'}"
    errors = [line.strip() for line in out.text.splitlines() if "No such image" in line or "Error" in line]
    return CheckResult(host.name, "image", FAIL, f"pinned digest {_short(want)} not present{other}",
                       " | ".join(errors[:2]) or first_lines(out.text, 2), f"docker pull {image}")


def _short(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    return f"{algo}:{hexd[:12]}" if hexd else digest[:19]
