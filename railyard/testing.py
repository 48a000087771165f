"""Fakes for testing code that drives railyard, without hosts, root or a network.

Not for production use: like fabric.testing, this module is shipped so that tests (railyard's own and
those of code built on it) can import it, and nothing in railyard imports it.

    FakeSession     a Session that answers from a script and fails on an unexpected command
    answer          a FakeSession answer to a joined probe script (railyard.facts.probe), section by section
    FakeClock       a clock whose sleep() only moves its time on (railyard.apply.executor.clock)
    FakeDockerHost  a host whose docker answers run/ps/inspect/logs/stop/start/rm/kill the way the
                    executor, health and recover ask, with its GPUs and their processes

    host = FakeDockerHost(inventory_host)
    host.behave("vllm-tp8", log="INFO:     Application startup complete.")
    with Runner([inventory_host], sessions={host.name: host.session}) as runner:
        ...
    assert not host.unexpected
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

from .facts.probe import MISSING_MARK
from .inventory import Host
from .transport import Result, Session

__all__ = ["FakeSession", "answer", "FakeClock", "FakeDockerHost", "FakeContainer", "FakeGpuProcess"]


class FakeSession(Session):
    """A session that answers from a script, for unit tests and plans: each rule is an exact
    command or a compiled regex with the Result fields to return. An unexpected command fails
    the test (AssertionError), as fabric's MockRemote does; `calls` records what ran.

        s = FakeSession(host, {"docker inspect x": (1, "", "Error: No such object: x")})
    """

    def __init__(self, host: Host, rules=None):
        super().__init__(host)
        self.rules: list = []
        self.calls: list[str] = []
        for pattern, reply in (rules or {}).items():
            self.on(pattern, reply)

    def on(self, pattern, reply) -> "FakeSession":
        """reply: (rc, stdout[, stderr]) or a function of the command returning that."""
        self.rules.append((pattern, reply))
        return self

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None,
            on_output: Callable[[str], None] | None = None) -> Result:
        self.calls.append(command)
        for pattern, reply in self.rules:
            hit = pattern == command if isinstance(pattern, str) else pattern.search(command)
            if hit:
                got = reply(command) if callable(reply) else reply
                rc, out, err = (tuple(got) + ("",))[:3]
                if on_output and out:
                    on_output(out)
                return Result(self.host.name, command, rc, out, err, 0.0)
        raise AssertionError(f"{self.host.name}: unexpected command: {command}")


def answer(outputs: dict[str, str | tuple[int, str]]):
    """A FakeSession answer to a joined script: each section's output (or (rc, output)) tagged as a
    host would print it; a section not in outputs reports its tool missing."""
    def reply(script: str) -> tuple[int, str]:
        m = re.search(r"^T='?([^'\n]+)'?$", script, re.M)
        assert m is not None, "not a joined probe script (no T= token line)"
        token = m.group(1)
        out = []
        for key in re.findall(r"^ry (\S+) \d+ ", script, re.M):
            got = outputs.get(key, (127, MISSING_MARK + key + "\n"))
            rc, text = got if isinstance(got, tuple) else (0, got)
            out += [f"{token} {key}|{line}" for line in text.splitlines()] + [f"{token} {key}|", f"{token} {key}|@@rc={rc}"]
        return 0, "\n".join(out) + "\n"
    return reply


class FakeClock:
    """monotonic() and sleep() where sleeping only moves the time on: a wait of minutes takes none.

        monkeypatch.setattr(railyard.apply.executor, "clock", FakeClock())
    """

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


# ---------------------------------------------------------------- a docker host

@dataclass
class FakeGpuProcess:
    gpu_uuid: str
    pid: int
    name: str
    used_mib: int
    container: str = ""   # the container whose process it is ("" for none: a process of the host)
    state: str = "S"      # its state in /proc/PID/stat (T: stopped)


@dataclass
class FakeContainer:
    name: str
    config: str = ""            # the railyard.config label
    status: str = "running"     # running | exited | created
    exit_code: int = 0
    pid: int = 0
    started: str = "2026-12-01T08:00:00.000000000Z"
    image: str = "sha256:ab"
    log: str = ""
    argv: str = ""              # the docker run line that made it

    @property
    def running(self) -> bool:
        return self.status == "running"


@dataclass
class Behaviour:
    """What a container does when docker starts it: prints log, or exits with `exits` at once;
    gpu: (uuid, process name, MiB) of the processes it runs on the GPUs while it runs."""
    log: str = ""
    exits: int | None = None
    gpu: list[tuple[str, str, int]] = field(default_factory=list)


# FakeDockerHost.http's reply: (HTTP code, body), or a function of the curl command returning that; code 0: no answer
HttpReply = tuple[int, str] | Callable[[str], tuple[int, str]]


class FakeDockerHost:
    """A host with docker and GPUs, as a FakeSession: `docker run` makes a container that runs (or
    exits, as told by behave()), inspect/ps/logs show it, stop/start/kill/rm change it, nvidia-smi shows
    the GPU processes of the running ones. curl gets the answer set with http() for its port and path,
    otherwise 200 while a container runs on the host and no answer when none does. Files written
    (write_remote) are kept and read back. Every other command fails (AssertionError, and recorded in
    `unexpected`, as railyard's per-host fan-out turns exceptions into that host's error)."""

    def __init__(self, host: Host, gpus: list[tuple[int, str, str, int, int]] | None = None, log: str = "",
                 exits: int | None = None, journal: list[str] | None = None):
        """gpus: (index, uuid, name, memory used MiB, memory total MiB) as nvidia-smi --query-gpu shows them;
        log, exits: what every container does that behave() says nothing of; journal: a list shared by
        several fake hosts, where each one's events go as `HOST: EVENT`, in the order they happened."""
        self.host = host
        self.name = host.name
        self.containers: dict[str, FakeContainer] = {}
        self.behaviour: dict[str, Behaviour] = {}
        self.default = Behaviour(log, exits)
        self.gpus = list(gpus or [])
        self.gpu_procs: list[FakeGpuProcess] = []
        self.images: dict[str, str | None] = {}   # image -> its id (None: not pulled); not listed: pulled
        self.files: dict[str, str] = {}            # path (~/ for the home) -> content: what write_remote wrote
        self.missing_files: set[str] = set()       # `test -f` fails for these (every other file is there);
        #                                            `test -s` holds only for a file in `files` (a secret written)
        self.routes: dict[tuple[int, str], HttpReply] = {}
        self.extra: dict[str, object] = {}         # more joined-probe sections: key -> output or (rc, output)
        self.unexpected: list[str] = []
        self.events = _Events(self.name, journal)  # "run NAME", "stop NAME", ... in the order they happened
        self._next_pid = 4000
        self.session = _DockerSession(self)

    # -------------------------------------------------------- set up

    def behave(self, name: str, log: str = "", exits: int | None = None,
               gpu: list[tuple[str, str, int]] | None = None) -> "FakeDockerHost":
        self.behaviour[name] = Behaviour(log, exits, list(gpu or []))
        if name in self.containers:
            self.containers[name].log = log
        return self

    def container(self, name: str, config: str = "", status: str = "running", exit_code: int = 0,
                  log: str | None = None) -> FakeContainer:
        """A container that is there already (a previous launch's)."""
        c = FakeContainer(name, config, status, exit_code, log=log if log is not None else self._log(name))
        self.containers[name] = c
        if c.running:
            self._start(c, fresh=False)
        return c

    def http(self, port: int, path: str, reply: HttpReply) -> "FakeDockerHost":
        """reply: (code, body), or a function of the command returning that; code 0 is no answer."""
        self.routes[(port, path)] = reply
        return self

    # -------------------------------------------------------- what docker does

    def _log(self, name: str) -> str:
        return self.behaviour.get(name, self.default).log

    def _start(self, c: FakeContainer, fresh: bool = True) -> None:
        b = self.behaviour.get(c.name, self.default)
        c.log = b.log if fresh else c.log
        if b.exits is not None:
            c.status, c.exit_code, c.pid = "exited", b.exits, 0
            return
        self._next_pid += 100
        c.status, c.exit_code, c.pid = "running", 0, self._next_pid
        for i, (uuid, pname, mib) in enumerate(b.gpu):
            self.gpu_procs.append(FakeGpuProcess(uuid, c.pid + 1 + i, pname, mib, c.name))

    def _end(self, c: FakeContainer, code: int) -> None:
        c.status, c.exit_code, c.pid = "exited", code, 0
        self.gpu_procs = [p for p in self.gpu_procs if p.container != c.name]

    def kill(self, name: str, code: int = 137) -> None:
        """The container dies (a crash, `docker kill`): its GPU processes go with it, unless told otherwise."""
        self.events.append(f"kill {name}")
        self._end(self.containers[name], code)

    def running(self) -> list[str]:
        return [n for n, c in self.containers.items() if c.running]

    # -------------------------------------------------------- answering commands

    def reply(self, command: str, stdin: bytes | None) -> tuple[int, str, str]:
        if command.startswith("T="):
            return (*answer(self._sections())(command), "")
        if command.startswith("exec 4<&0; printf 'header"):     # request() with the key on fd 3
            command = command.split(" | ", 1)[1].rsplit(" -K /dev/fd/3", 1)[0]
        if command.startswith("set -e; umask 077; f="):            # write_remote
            path = _home(shlex.split(command.split("f=", 1)[1].split(";", 1)[0])[0])
            self.files[path] = (stdin or b"").decode()
            return 0, "", ""
        if " | " in command or "; echo @@last; " in command:
            return self._logs_pipeline(command)
        argv = shlex.split(command.replace(" 2>&1", "").replace(" 2>/dev/null || echo @@railyard-missing", ""))
        verb = argv[:2]
        if argv[0] == "cat" and argv[1] == "--":
            got = self.files.get(_home(argv[2]))
            return 0, ("@@railyard-missing\n" if got is None else got), ""
        if argv[0] == "test" and argv[1] == "-f":
            return (1 if _home(argv[2]) in self.missing_files else 0), "", ""
        if argv[0] == "test" and argv[1] == "-s":
            return (0 if self.files.get(_home(argv[2])) else 1), "", ""
        if argv[0] == "mkdir":
            return 0, "", ""
        if argv[0] == "curl":
            return self._curl(argv)
        if verb == ["docker", "run"]:
            return self._run(command, argv)
        if verb == ["docker", "inspect"] and argv[2:4] == ["--format", "{{json .}}"]:
            return self._inspect(argv[4])
        if verb == ["docker", "image"]:
            return self._image(argv)
        if verb == ["docker", "logs"]:
            name = argv[-1]
            c = self.containers.get(name)
            if c is None:
                return 1, f"Error response from daemon: No such container: {name}\n", ""
            lines = c.log.splitlines()
            if "--tail" in argv:
                n = int(argv[argv.index("--tail") + 1])
                lines = lines[-n:] if n else []
            return 0, "".join(ln + "\n" for ln in lines), ""
        if verb == ["docker", "ps"]:
            names = [n for n, c in self.containers.items() if c.running or "-a" in argv]
            return 0, "".join(n + "\n" for n in names), ""
        if verb[0] == "docker" and verb[1] in ("stop", "start", "rm", "kill"):
            return self._lifecycle(verb[1], argv[-1])
        raise AssertionError(f"{self.name}: unexpected command: {command}")

    def _no_such(self, name: str) -> tuple[int, str, str]:
        return 1, "", f"Error response from daemon: No such container: {name}"

    def _lifecycle(self, verb: str, name: str) -> tuple[int, str, str]:
        c = self.containers.get(name)
        self.events.append(f"{verb} {name}")
        if verb == "rm":
            if c is None:
                return self._no_such(name)
            if c.running:
                self._end(c, 137)
            del self.containers[name]
            return 0, name + "\n", ""
        if c is None:
            return self._no_such(name)
        if verb == "stop":
            if c.running:
                self._end(c, 0)
        elif verb == "kill":
            if not c.running:
                return 1, "", f"Error response from daemon: cannot kill container: {name}: container is not running"
            self._end(c, 137)
        elif not c.running:
            self._start(c)
        return 0, name + "\n", ""

    def _run(self, command: str, argv: list[str]) -> tuple[int, str, str]:
        name = argv[argv.index("--name") + 1]
        if name in self.containers:
            return 125, "", (f'docker: Error response from daemon: Conflict. The container name "/{name}" is already '
                             "in use by container \"f00d\". You have to remove (or rename) that container to be able "
                             "to reuse that name.")
        label = re.search(r"--label railyard\.config=(\w+)", command)
        ref = next((a for a in argv if "@sha256:" in a and not a.startswith("-")), "")
        c = FakeContainer(name, label.group(1) if label else "", "created", image=self.image_id(ref) or "", argv=command)
        self.containers[name] = c
        self.events.append(f"run {name}")
        b = self.behaviour.get(name, self.default)
        if b.exits is not None and b.exits >= 125:  # docker itself refused: it stays Created
            c.log = ""
            return b.exits, "", b.log
        self._start(c)
        return 0, "f00d" * 16 + "\n", ""

    def _inspect(self, name: str) -> tuple[int, str, str]:
        c = self.containers.get(name)
        if c is None:
            return 1, "", f"Error: No such object: {name}"
        doc = {"State": {"Running": c.running, "Status": c.status, "Pid": c.pid, "ExitCode": c.exit_code,
                         "StartedAt": c.started},
               "Config": {"Labels": {"railyard.config": c.config}}, "Image": c.image, "Name": "/" + name}
        return 0, json.dumps(doc) + "\n", ""

    def image_id(self, ref: str) -> str | None:
        """The id of a pulled image: as set in `images`, else one made from its name."""
        if ref in self.images:
            return self.images[ref]
        return "sha256:" + hashlib.sha256(ref.encode()).hexdigest()

    def _image(self, argv: list[str]) -> tuple[int, str, str]:
        image = argv[-1]
        refs = [r for r in list(self.images) + [c.argv for c in self.containers.values()] if r]
        by_id = [r for r in (next((a for a in shlex.split(x) if "@sha256:" in a and not a.startswith("-")), x)
                             for x in refs) if self.image_id(r) == image]
        iid = image if by_id else self.image_id(image)
        if iid is None:
            return 1, "[]\n", f"Error response from daemon: No such image: {image}"
        digests = [r for r in dict.fromkeys(by_id or [image]) if "@sha256:" in r]
        if "--format" in argv:
            return 0, f"{iid} {json.dumps(digests)}\n", ""
        return 0, json.dumps([{"Id": iid, "RepoDigests": digests}]) + "\n", ""

    def _logs_pipeline(self, command: str) -> tuple[int, str, str]:
        """The gates' `docker logs NAME | grep -F -e P... | cut; echo @@last; docker logs --tail 1 NAME`
        and the timeline's `docker logs --timestamps NAME | grep -F ... | cut`."""
        first = command.split(" | ", 1)[0]
        argv = shlex.split(first.replace(" 2>&1", ""))
        c = self.containers.get(argv[-1])
        log = c.log if c else ""
        grep = shlex.split(command.split(" | ", 2)[1])
        pats = [grep[i + 1] for i, a in enumerate(grep) if a == "-e"]
        stamp = (c.started if c else "") + " " if "--timestamps" in argv else ""
        matched = "".join(stamp + ln[:600] + "\n" for ln in log.splitlines() if any(p in ln for p in pats))
        if "; echo @@last; " not in command:
            return 0, matched, ""
        last = log.splitlines()[-1] + "\n" if log.strip() else ""
        return 0, matched + "@@last\n" + last, ""

    def _curl(self, argv: list[str]) -> tuple[int, str, str]:
        url = argv[-1]
        m = re.match(r"https?://[^/:]+:(\d+)(/\S*)", url)
        port, path = (int(m.group(1)), m.group(2)) if m else (0, url)
        route = self.routes.get((port, path))
        if route is not None:
            code, body = route(" ".join(argv)) if callable(route) else route
        else:
            code, body = (200, "") if self.running() else (0, "")
        plain = "%{http_code}" in argv   # the gates' form: -o /dev/null -w '%{http_code}'
        if code == 0:
            err = f"curl: (7) Failed to connect to 127.0.0.1 port {port}: Connection refused"
            return 7, ("000" if plain else "\n@@000 0.001 "), err
        if plain:
            return (0 if code < 400 else 22), str(code), ""
        return 0, f"{body}\n@@{code} 0.010 ", ""

    def _sections(self) -> dict:
        """The joined probes' sections this host answers: its GPUs, their processes, ps, containers' pids."""
        out: dict = {
            "gpus": "".join(f"{i}, {u}, {n}, {used + sum(p.used_mib for p in self.gpu_procs if p.gpu_uuid == u)}, "
                            f"{total}\n" for i, u, n, used, total in self.gpus),
            "apps": "".join(f"{p.gpu_uuid}, {p.pid}, {p.name}, {p.used_mib}\n" for p in self.gpu_procs),
            "states": "".join(f"{p.pid} {p.state}\n" for p in self.gpu_procs),
            "ps": "1 0 Ss\n" + "".join(f"{c.pid} 1 Ss\n" for c in self.containers.values() if c.pid) + "".join(
                f"{p.pid} {self.containers[p.container].pid if p.container in self.containers else 1} {p.state}l\n"
                for p in self.gpu_procs),
            "mains": "".join(f"{c.pid} /{c.name}\n" for c in self.containers.values() if c.running),
        }
        out.update(self.extra)
        return out


def _home(path: str) -> str:
    """A path as the host's shell expanded it from railyard's quoting ("$HOME"/x), written ~/x."""
    return "~/" + path[len("$HOME/"):] if path.startswith("$HOME/") else path


class _Events(list):
    def __init__(self, host: str, journal: list[str] | None):
        super().__init__()
        self.host, self.journal = host, journal

    def append(self, event: str) -> None:
        super().append(event)
        if self.journal is not None:
            self.journal.append(f"{self.host}: {event}")


class _DockerSession(FakeSession):
    def __init__(self, fake: FakeDockerHost):
        super().__init__(fake.host)
        self.fake = fake

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None,
            on_output: Callable[[str], None] | None = None) -> Result:
        self.calls.append(command)
        for pattern, reply in self.rules:   # rules added with on() come first
            if (pattern == command if isinstance(pattern, str) else pattern.search(command)):
                got = reply(command) if callable(reply) else reply
                rc, out, err = (tuple(got) + ("",))[:3]
                return Result(self.host.name, command, rc, out, err, 0.0)
        try:
            rc, out, err = self.fake.reply(command, stdin)
        except AssertionError:
            self.fake.unexpected.append(command)
            raise
        except (ValueError, IndexError) as e:
            self.fake.unexpected.append(command)
            raise AssertionError(f"{self.host.name}: command the fake docker host cannot read ({e}): {command}") from None
        if on_output and out:
            on_output(out)
        return Result(self.host.name, command, rc, out, err, 0.0)
