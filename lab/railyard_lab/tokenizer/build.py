"""Build the lab checkpoint's tokenizer, offline and reproducibly (the files beside this script).

A word-level tokenizer (HF `tokenizers`: WordLevel over the `WhitespaceSplit` pre-tokenizer: one
token per whitespace-separated word, as the stand-in has always counted), its vocabulary the VOCAB most frequent
pieces of AIPerf's own bundled corpus (`aiperf/dataset/generator/assets/shakespeare.txt`, the
text AIPerf draws synthetic prompts from), ties broken by the piece itself; everything else is
`UNK`, itself a word, so that decode-then-encode gives back the same count. AIPerf loads it as a
`PreTrainedTokenizerFast` from the checkpoint directory; the lab's vLLM stand-in counts tokens
with the same vocabulary and the same split (railyard_lab.sim.vllm.token_ids).

    <aiperf venv>/bin/python lab/railyard_lab/tokenizer/build.py     # rewrites the three files
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

VOCAB = 4000
UNK = "UNK"
HERE = Path(__file__).resolve().parent


def corpus() -> str:
    import aiperf
    return (Path(aiperf.__file__).parent / "dataset" / "generator" / "assets" / "shakespeare.txt").read_text()


def build(text: str, out: Path = HERE) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers
    counts = collections.Counter(text.split())
    pieces = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w != UNK][:VOCAB - 1]
    vocab = {UNK: 0, **{w: i + 1 for i, w in enumerate(pieces)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    # UNK is deliberately no special token: AIPerf's decode keeps it, so it is counted as a word
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 202752, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text("{}\n")
    covered = sum(counts[w] for w in pieces) / max(1, sum(counts.values()))
    return {"vocab": len(vocab), "coverage": covered}


if __name__ == "__main__":
    got = build(corpus())
    print(f"wrote {HERE}/tokenizer.json: {got['vocab']} pieces, {got['coverage'] * 100:.1f} % of the corpus", file=sys.stderr)
