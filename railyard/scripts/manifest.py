#!/usr/bin/env python3
"""Manifest of a model directory, run on a host with its system python3 (standard library only).

    python3 - ROOT size|content [--rehash] < manifest.py

Prints one JSON document: every file under ROOT (any `.cache/` directory excluded; a symlink
counts as the file it points to, as in a Hugging Face cache snapshot) with its size and mtime, its sha256 in `content` mode, and what the model's own files say
(`config.json` parsed, the shards `model.safetensors.index.json` names). Digests are
computed with every core (one process per file, largest first) and cached in
ROOT/.cache/railyard/digests.json per (path, size, mtime, ctime, inode): re-verifying an
unchanged tree costs one stat pass, and a file rewritten with its mtime put back still
changes ctime, so it is hashed again. Python 3.8+ (Ubuntu 20.04 and later, DGX OS).
"""

import hashlib
import json
import os
import sys
import time
import multiprocessing
import stat
from concurrent.futures import ProcessPoolExecutor

CACHE_DIR = os.path.join(".cache", "railyard")
CHUNK = 8 << 20


def files_under(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".cache")
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:  # a Hugging Face cache snapshot is symlinks into ../../blobs: the file is what they point to
                st = os.stat(path)
            except OSError:
                continue  # a dangling link: not a file (the index check names a missing shard)
            if not stat.S_ISREG(st.st_mode):
                continue
            out[os.path.relpath(path, root)] = st
    return out


def sha256_file(path):
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        try:  # a larger readahead keeps the disk busy while this core hashes
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def load_cache(root):
    try:
        with open(os.path.join(root, CACHE_DIR, "digests.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save_cache(root, cache):
    d = os.path.join(root, CACHE_DIR)
    try:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, "digests.json.%d" % os.getpid())
        with open(tmp, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, os.path.join(d, "digests.json"))
        return True
    except OSError:
        return False


def read_json(root, name):
    path = os.path.join(root, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"_error": "%s: %s" % (name, e)}


def main(argv):
    root, mode = argv[0], argv[1]
    rehash = "--rehash" in argv[2:]
    started = time.time()
    doc = {"root": root, "exists": os.path.isdir(root), "mode": mode, "files": {}, "cpus": os.cpu_count() or 1}
    if not doc["exists"]:
        print(json.dumps(doc))
        return 0
    stats = files_under(root)
    for rel, st in stats.items():
        doc["files"][rel] = {"size": st.st_size, "mtime": int(st.st_mtime)}
    if mode == "content":
        cache = {} if rehash else load_cache(root)
        keys = {rel: [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for rel, st in stats.items()}
        todo = [rel for rel in stats if (cache.get(rel) or [None])[:4] != keys[rel]]
        todo.sort(key=lambda r: -stats[r].st_size)
        digests = {rel: cache[rel][4] for rel in stats if rel not in todo}
        if todo:
            workers = max(1, min(doc["cpus"], len(todo)))
            # fork: the script arrives on stdin, so workers cannot re-import it
            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
                for rel, digest in zip(todo, pool.map(sha256_file, [os.path.join(root, r) for r in todo])):
                    digests[rel] = digest
        for rel, digest in digests.items():
            doc["files"][rel]["sha256"] = digest
        new_cache = {rel: keys[rel] + [digests[rel]] for rel in stats}
        doc["cache"] = {"hits": len(stats) - len(todo), "hashed": len(todo),
                        "bytes_hashed": sum(stats[r].st_size for r in todo),
                        "saved": save_cache(root, new_cache) if new_cache != cache else True}
    doc["config"] = read_json(root, "config.json")
    index = read_json(root, "model.safetensors.index.json")
    if index is not None and "_error" not in index:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        index = {"shards": sorted(set(weight_map.values())) if isinstance(weight_map, dict) else None,
                 "total_size": (index.get("metadata") or {}).get("total_size")}
    doc["index"] = index
    doc["seconds"] = round(time.time() - started, 3)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
