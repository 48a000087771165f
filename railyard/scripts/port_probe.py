"""Can this host reach the TCP ports the deployment will open between its hosts? Run by preflight on
every host at once (`python3 -c`, standard library only), and by launch on the dialing hosts when a
gate times out.

    port_probe.py WAIT MORE [listen ADDR PORT N]... [dial ADDR PORT]...

listen: hold a listener on ADDR:PORT until N peers have connected or WAIT + MORE s have passed; a port
already taken is left alone (what listens there answers the dialers). dial: connect to ADDR:PORT,
again every 0.25 s while refused or unanswered, until connected or WAIT s have passed (the peer's
listener may start a moment later); no route (ICMP unreachable) ends it. One line per item, when it
ends:

    listen ADDR PORT ok|in-use|no-address|error FROM=ip,ip START END
    dial ADDR PORT connected|refused|timeout|unreachable|error TRIES START END
"""

import errno
import socket
import sys
import threading
import time

LOCK = threading.Lock()


def say(*parts):
    with LOCK:
        print(*parts, flush=True)


def listen(addr, port, want, until):
    start = time.time()
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        s.listen(64)
    except OSError as e:
        named: dict[int | None, str] = {errno.EADDRINUSE: "in-use", errno.EADDRNOTAVAIL: "no-address"}
        what = named.get(e.errno, "error")
        say("listen", addr, port, what, "-", f"{start:.3f}", f"{time.time():.3f}")
        return
    peers: list[str] = []
    s.settimeout(0.2)
    while len(set(peers)) < want and time.time() < until:
        try:
            c, who = s.accept()
        except socket.timeout:
            continue
        peers.append(who[0])
        c.close()
    s.close()
    say("listen", addr, port, "ok", ",".join(sorted(set(peers))) or "-", f"{start:.3f}", f"{time.time():.3f}")


def dial(addr, port, until):
    start = time.time()
    tries = 0
    what = "timeout"
    while True:
        tries += 1
        s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        s.settimeout(max(0.2, min(1.0, until - time.time())))
        try:
            s.connect((addr, port))
            what = "connected"
        except socket.timeout:
            what = "timeout"
        except OSError as e:
            named: dict[int | None, str] = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable",
                                            errno.ENETUNREACH: "unreachable", errno.ETIMEDOUT: "timeout"}
            what = named.get(e.errno, "error")
        finally:
            s.close()
        if what in ("connected", "unreachable") or time.time() + 0.25 >= until:  # no route: no retry helps
            break
        time.sleep(0.25)
    say("dial", addr, port, what, tries, f"{start:.3f}", f"{time.time():.3f}")


def main(argv):
    wait, more = float(argv[0]), float(argv[1])
    now = time.time()
    threads = []
    i = 2
    while i < len(argv):
        if argv[i] == "listen":
            threads.append(threading.Thread(target=listen, args=(argv[i + 1], int(argv[i + 2]), int(argv[i + 3]),
                                                                 now + wait + more)))
            i += 4
        else:
            threads.append(threading.Thread(target=dial, args=(argv[i + 1], int(argv[i + 2]), now + wait)))
            i += 3
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
