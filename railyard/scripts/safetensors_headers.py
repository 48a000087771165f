#!/usr/bin/env python3
"""The headers of a checkpoint, run on a host with its system python3 (standard library only).

    python3 - DIR < safetensors_headers.py

Prints one JSON document: `config.json` parsed, `model.safetensors.index.json` parsed (when
present), and for every shard (the files the index names, or every top-level `*.safetensors`
without an index) its size and its header: the 8-byte little-endian length and the JSON that
follows (dtype, shape, data_offsets per tensor). Only the header bytes are read, never the
tensor data, so a 470 GB checkpoint costs a few MB of reads. A shard too short to hold its
header, or a header that is not JSON, is reported as that file's `error`; deciding what is
wrong with the rest is the caller's job. Python 3.8+.
"""

import json
import os
import sys

INDEX = "model.safetensors.index.json"
MAX_HEADER = 512 << 20  # far above any real header; a larger length means a corrupt file


def read_json(path):
    """(value, error): the parsed file, or why it could not be parsed."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8")), None
    except FileNotFoundError:
        return None, "missing"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, "%s: %s" % (type(e).__name__, e)


def read_header(path):
    """One shard: {"size", "header_len", "header"} or {"size", "error"}."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return {"size": size, "error": "truncated: %d bytes, too short for the 8-byte header length" % size}
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or n > size - 8:
                return {"size": size, "header_len": n,
                        "error": "truncated or corrupt: header length %d, but the file has %d bytes" % (n, size)}
            raw = f.read(n)
    except FileNotFoundError:
        return {"error": "missing"}
    except OSError as e:
        return {"error": "unreadable: %s" % (e.strerror or e)}
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return {"size": size, "header_len": n, "error": "header is not JSON (%s)" % e}
    if not isinstance(header, dict):
        return {"size": size, "header_len": n, "error": "header is not a JSON object"}
    header.pop("__metadata__", None)
    return {"size": size, "header_len": n, "header": header}


def collect(root):
    root = os.path.expanduser(root)
    doc = {"dir": os.path.abspath(root), "exists": os.path.isdir(root), "config": None, "config_error": None,
           "index": None, "index_error": None, "files": {}}
    if not doc["exists"]:
        return doc
    doc["config"], doc["config_error"] = read_json(os.path.join(root, "config.json"))
    names = []
    if os.path.exists(os.path.join(root, INDEX)):
        doc["index"], doc["index_error"] = read_json(os.path.join(root, INDEX))
        weight_map = doc["index"].get("weight_map") if isinstance(doc["index"], dict) else None
        if isinstance(weight_map, dict):
            names = sorted(set(str(v) for v in weight_map.values()))
            doc["index"] = {"shards": names, "tensors": len(weight_map)}
        elif doc["index_error"] is None:
            doc["index_error"] = "no weight_map"
    else:
        names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    for name in names:
        doc["files"][name] = read_header(os.path.join(root, name))
    return doc


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: python3 - DIR < safetensors_headers.py\n")
        return 2
    sys.stdout.write(json.dumps(collect(argv[1]), separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
