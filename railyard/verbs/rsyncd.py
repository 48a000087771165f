"""sync-model's opt-in transport without SSH's cipher: a one-time rsync daemon on each target.

`sync_transport: rsyncd` (or `inv sync-model --transport rsyncd`). For each target, over railyard's
own SSH session to it, one shell starts a real `rsync --daemon --no-detach` and watches it:

- a fresh 0700 directory (`mktemp -d /tmp/railyard-rsyncd.XXXXXXXXXX`) holds the config, the
  0600 secrets file, the pid, lock and log files, and a link `module` to the model directory (so no
  path of the inventory is ever written into the config);
- the daemon binds the target's serve-rail address only (`address`), on `sync_rsyncd_port` or a
  free port picked from a few random candidates, `hosts allow` is the source's rail address,
  `auth users` one user with a one-time random secret, `max connections` twice the streams (a
  stream's resume pass and its whole-file pass follow each other, and the daemon's child of the first
  may not have exited yet when the second connects), `use chroot = no`, and the daemon runs as the SSH user
  (`uid`/`gid` root's when that is root): files are owned as the SSH path's rsync leaves them;
- the secret travels on stdin only (the daemon's shell reads it; the source's rsync gets it as
  RSYNC_PASSWORD from its shell's `read`), never in an argv, a log or railyard's output;
- the shell removes the daemon (its whole process group) and the directory when it is told to
  (`stop`), when the daemon dies, and when its SSH channel goes away (a write to it fails: a
  railyard that was killed or lost its connection leaves nothing behind).

The copy itself is the SSH path's rsync (the same streams, --partial/--append-verify resume,
progress2, stats, timeouts), pointed at `rsync://railyard@RAIL_IP:PORT/railyard/`; the
verification after is the same. Unencrypted on the rail: for public weights on direct links.
"""

from __future__ import annotations

import ipaddress
import random
import re
import secrets
import threading
import time
from dataclasses import dataclass, field

from ..inventory import Host
from ..transport import RemotePath, Result, Session, Sh, cmd, q

MODULE = "railyard"
AUTH_USER = "railyard"
MARK = "@@railyard-rsyncd"
TMP_TEMPLATE = "/tmp/railyard-rsyncd.XXXXXXXXXX"
AUTO_PORTS = (20000, 32767)  # below Linux's ephemeral range (32768-60999)
START_WAIT_S = 10


def new_secret() -> str:
    """A one-time secret for one daemon: 256 random bits, hex (rsync reads it as one line)."""
    return secrets.token_hex(32)


def candidate_ports(port: int, n: int = 6, rng: random.Random | None = None) -> list[int]:
    """The port to try (sync_rsyncd_port), or with 0 a few random ones, the next tried when one is in use."""
    if port:
        return [int(port)]
    return (rng or random.SystemRandom()).sample(range(AUTO_PORTS[0], AUTO_PORTS[1] + 1), n)


def render_config(address: str, source_ip: str, streams: int, io_timeout_s: int) -> str:
    """rsyncd.conf for one copy. @DIR@ is filled in on the target (its temp directory); the uid/gid
    lines become root's when the SSH user is root (rsyncd would switch to nobody) and go otherwise (a
    daemon that is not root runs as its user, and setting a gid would fail in setgroups). Every other
    value is an address or a number checked here."""
    address, source_ip = str(ipaddress.IPv4Address(address)), str(ipaddress.IPv4Address(source_ip))
    lines = [
        "# railyard sync-model: one copy, removed after it",
        "pid file = @DIR@/rsyncd.pid",
        "lock file = @DIR@/rsyncd.lock",
        "log file = @DIR@/rsyncd.log",
        f"address = {address}",
        "reverse lookup = no",
        "forward lookup = no",
        "use chroot = no",
        "uid = @UID@",
        "gid = @GID@",
        "",
        f"[{MODULE}]",
        "path = @DIR@/module",
        "read only = false",
        "list = false",
        f"auth users = {AUTH_USER}",
        "secrets file = @DIR@/secrets",
        "strict modes = true",
        f"hosts allow = {source_ip}",
        "hosts deny = *",
        f"max connections = {2 * int(streams)}",  # a stream's next pass may connect before the last one's child exits
        f"timeout = {int(io_timeout_s)}",
        "transfer logging = no",
        "refuse options = delete* remove-source-files",
        "",
    ]
    return "\n".join(lines)


def _hex_address(address: str) -> tuple[str, str]:
    """An address as /proc/net/tcp prints it (the host's 32-bit integer in hex), in either byte order."""
    packed = ipaddress.IPv4Address(address).packed
    return packed[::-1].hex().upper(), packed.hex().upper()


def daemon_script(dest_path: str, address: str, source_ip: str, ports: list[int], streams: int,
                  io_timeout_s: int) -> Sh:
    """The shell run on the target over railyard's SSH session; the secret is its stdin's first line.
    It prints `MARK dir DIR PID`, then `MARK ready PORT` (or `MARK error KIND PORT LINE`), then one dot a
    second while the daemon runs, and `MARK removed DIR` when it has removed everything."""
    conf = render_config(address, source_ip, streams, io_timeout_s)
    le, be = _hex_address(address)
    return Sh(f"""set -u
IFS= read -r secret || {{ echo "{MARK} error start 0 no secret on stdin"; exit 1; }}
umask 077
d=$(mktemp -d {TMP_TEMPLATE}) || {{ echo "{MARK} error start 0 mktemp failed in /tmp"; exit 1; }}
pid=
stop() {{
  if [ -n "$pid" ]; then
    env kill -TERM -- "-$pid" 2>/dev/null
    ( sleep 5; env kill -KILL -- "-$pid" ) </dev/null >/dev/null 2>&1 &
    k=$!; wait "$pid" 2>/dev/null; kill "$k" 2>/dev/null
  fi
  rm -rf -- "$d"; echo "{MARK} removed $d" 2>/dev/null
}}
trap stop EXIT
trap 'exit 143' TERM INT HUP
trap '' PIPE
echo "{MARK} dir $d $$"
untime='s/^[0-9/]* [0-9:]* \\[[0-9]*\\] //'
ln -s -- {q(RemotePath(dest_path))} "$d/module"
printf '%s:%s\\n' {AUTH_USER} "$secret" > "$d/secrets"
secret=
if [ "$(id -u)" = 0 ]; then ids="-e s#@UID@#0#g -e s#@GID@#$(id -g)#g"; else ids="-e /@UID@/d -e /@GID@/d"; fi
printf '%s' {q(conf)} | sed -e "s#@DIR@#$d#g" $ids > "$d/rsyncd.conf"
for port in {" ".join(str(int(p)) for p in ports)}; do
  hp=$(printf '%04X' "$port")
  if grep -Eq ": ({le}|{be}):$hp 00000000:0000 0A " /proc/net/tcp; then
    echo "{MARK} error in-use $port another process listens there"; continue
  fi
  : > "$d/rsyncd.log"
  setsid rsync --daemon --no-detach --config="$d/rsyncd.conf" --port="$port" </dev/null >"$d/out" 2>&1 &
  pid=$!
  n=0
  while [ $n -lt {START_WAIT_S * 20} ]; do
    if grep -Eq ": ({le}|{be}):$hp 00000000:0000 0A " /proc/net/tcp; then echo "{MARK} ready $port"; break 2; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05; n=$((n + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "{MARK} error start $port not listening after {START_WAIT_S} s"; exit 1
  fi
  wait "$pid"; rc=$?; pid=
  why=$(cat "$d/rsyncd.log" "$d/out" 2>/dev/null | grep -v -e 'rsyncd version' -e '^$' | sed -e "$untime" -e 1q)
  case "$why" in
    *"Address already in use"*) echo "{MARK} error in-use $port $why" ;;
    *) echo "{MARK} error start $port ${{why:-rsync --daemon exit $rc}}"; exit 1 ;;
  esac
done
[ -n "$pid" ] || exit 1
while kill -0 "$pid" 2>/dev/null; do
  printf '.\\n' 2>/dev/null || exit 0
  sleep 1 </dev/null >/dev/null 2>&1 & wait $!
done
echo "{MARK} error died 0 $(grep -v 'rsyncd version' "$d/rsyncd.log" | tail -n 1 | sed -e "$untime")"
exit 1
""")


def client_command(src_path: str, source_ip: str, address: str, port: int | str, rsync_argv: list[str],
                   io_timeout_s: int = 0) -> Sh:
    """One rsync stream on the source, to the target's daemon: rsync_argv is the stream's rsync and its options
    (sync.rsync_args, the SSH path's). stdin: the secret's line, then the file list (NUL-separated); the shell's
    `read` takes the first line into RSYNC_PASSWORD, rsync the rest. port: the daemon's, or the word PORT in a
    dry run's plan (a free one is picked at the start)."""
    argv = list(rsync_argv)
    if io_timeout_s:
        argv.append(f"--contimeout={int(io_timeout_s)}")
    argv += [f"--address={ipaddress.IPv4Address(source_ip)}", "./",
             f"rsync://{AUTH_USER}@{ipaddress.IPv4Address(address)}:{'PORT' if port == 'PORT' else int(port)}/{MODULE}/"]
    return Sh(f"cd {q(RemotePath(src_path))} && IFS= read -r RSYNC_PASSWORD && export RSYNC_PASSWORD && exec "
              + cmd(*argv))


# ---------------------------------------------------------------- errors, one line each

def start_error(target: Host, kind: str, port: str, why: str, configured: int) -> tuple[str, str]:
    """(line, fix) for a daemon that did not start."""
    addr = target.serve_rail.ip
    if kind == "in-use":
        fix = ("set sync_rsyncd_port to a free port, or 0 to let railyard pick one" if configured else
               "free a port in 20000-32767 on the host, or set sync_rsyncd_port")
        return f"{target.name}: rsync daemon: port {port} on {addr} is in use ({why})", fix
    if "Cannot assign requested address" in why:
        return (f"{target.name}: rsync daemon: {addr} is not an address of the host ({why})",
                f"check cluster_serve_rail and the rail's address on {target.name} (inv preflight)")
    if "failed to execute rsync" in why or "not found" in why:
        return f"{target.name}: rsync daemon: rsync is not installed ({why})", f"apt-get install rsync on {target.name}"
    if kind == "died":
        return (f"{target.name}: rsync daemon on {addr}:{port} stopped during the copy ({why or 'no log line'})",
                "run sync-model again: finished files are not sent again and partial ones are continued")
    return (f"{target.name}: rsync daemon did not start on {addr}:{port} ({why})",
            f"check rsync --daemon on {target.name} by hand, or use sync_transport: ssh")


def client_error(stderr: str, target: Host, source: Host, port: int) -> tuple[str, str] | None:
    """(line, fix) for what the daemon answered the source's rsync, or None (not a daemon refusal)."""
    addr = f"{target.serve_rail.ip}:{port}"
    if "@ERROR: auth failed" in stderr:
        return (f"the rsync daemon on {target.name} ({addr}) refused the secret (auth failed)",
                "run sync-model again (each run starts its own daemon with a fresh secret); "
                "is another copy to that port running?")
    if "@ERROR: access denied" in stderr or f"@ERROR: Unknown module '{MODULE}'" in stderr:
        # a module the client's address may not use is "unknown" to it (list = false)
        m = re.search(r"access denied to \S+ from \S+ \(([^)]*)\)", stderr)
        return (f"the rsync daemon on {target.name} ({addr}) refused {m[1] if m else 'the source'}: only "
                f"{source.serve_rail.ip} (the source's rail address) may connect",
                f"the source must reach {target.name} over the serve rail {target.vars['cluster_serve_rail']} "
                "(inv preflight)")
    if "@ERROR: max connections" in stderr:
        return (f"the rsync daemon on {target.name} ({addr}) refused a connection: more than twice its streams",
                "run sync-model again")
    if "Connection refused" in stderr:
        return (f"nothing listens on {addr} on {target.name} (the rsync daemon went away)",
                "run sync-model again")
    return None


# ---------------------------------------------------------------- one daemon's life

@dataclass
class Daemon:
    target: Host
    session: Session
    port: int = 0
    tmpdir: str = ""
    shell_pid: int = 0
    error: str = ""
    hint: str = ""
    result: Result | None = None
    secret: str = field(default_factory=new_secret, repr=False)
    _buf: str = ""
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, dest_path: str, source: Host, streams: int, io_timeout_s: int, timeout_s: float,
              configured_port: int) -> bool:
        """Start the daemon and wait until it listens (True) or failed (False, `error` and `hint` set)."""
        script = daemon_script(dest_path, self.target.serve_rail.ip, source.serve_rail.ip,
                               candidate_ports(configured_port), streams, io_timeout_s)
        in_use: list[tuple[str, str]] = []  # (port, why)

        def handle(line: str) -> None:
            parts = line.strip().split(" ", 4)
            if parts[0] != MARK or len(parts) < 3:
                return
            if parts[1] == "dir" and len(parts) >= 4 and not self.tmpdir:
                self.tmpdir, self.shell_pid = parts[2], int(parts[3])
            elif parts[1] == "ready" and not self.port and not self.error:
                self.port = int(parts[2])
                self._ready.set()
            elif parts[1] == "error" and len(parts) >= 4 and parts[2] == "in-use":
                in_use.append((parts[3], parts[4] if len(parts) > 4 else ""))
            elif parts[1] == "error" and len(parts) >= 4 and not self.port and not self.error:
                self.error, self.hint = start_error(self.target, parts[2], parts[3],
                                                    parts[4] if len(parts) > 4 else "", configured_port)
                self._ready.set()

        def seen(text: str) -> None:
            *lines, self._buf = (self._buf + text).split("\n")
            for line in lines:
                handle(line)

        def run() -> None:
            self.result = self.session.run(script, timeout=timeout_s, stdin=(self.secret + "\n").encode(),
                                           on_output=seen)
            if not self._ready.is_set() and not self.error:
                r = self.result
                if r.error:
                    self.error, self.hint = f"{self.target.name}: rsync daemon: {r.error.message}", r.error.hint
                elif in_use:
                    self.error, self.hint = start_error(self.target, "in-use", *in_use[-1], configured_port)
                else:
                    tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.rc}"]
                    self.error, self.hint = start_error(self.target, "start", "?", tail[0], configured_port)
            self._ready.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        self._ready.wait(START_WAIT_S * len(candidate_ports(configured_port)) + 30)
        if not self.port and not self.error:
            self.error, self.hint = (f"{self.target.name}: rsync daemon: no answer from its shell",
                                     "check the host's SSH and rsync, or use sync_transport: ssh")
        return bool(self.port) and not self.error

    @property
    def died(self) -> str:
        """A line when the daemon went away before stop(), else ''."""
        r = self.result
        if r is None or not self.port:
            return ""
        m = re.search(rf"{MARK} error died \S+ ?(.*)", r.stdout)
        return start_error(self.target, "died", str(self.port), m[1] if m else "", 0)[0] if m else ""

    def stop(self, wait_s: float = 10.0) -> bool:
        """Stop the daemon and remove its directory; True once its shell said so."""
        if self._thread is None:
            return True
        if self._thread.is_alive() and self.shell_pid:
            self.session.run(cmd("kill", "-TERM", str(self.shell_pid)) + " 2>/dev/null; true", timeout=wait_s)
        deadline = time.monotonic() + wait_s
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return self.result is not None and f"{MARK} removed" in self.result.stdout
