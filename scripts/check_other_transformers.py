"""Load an exported folder under a second transformers (e.g. 4.57.6, MiniMind's pin) and compare its greedy answer.

Usage:
  python scripts/check_other_transformers.py FOLDER --python OTHER_PYTHON [--prompt TEXT] [--tokens N]

OTHER_PYTHON is the interpreter of another environment that has torch and the other transformers installed (e.g.
`python -m venv ../tf4 && ../tf4/bin/pip install torch transformers==4.57.6`). Both this environment and that
one load FOLDER with AutoTokenizer and AutoModelForCausalLM (no custom code), read the prompt's greedy continuation
the RoPE base each version runs and the logits of the prompt and answer; they must agree (logits within 1e-4). Exit 0 when they do, 1 when they differ, 2 when a side cannot
load the folder (one line each).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

LOGITS_ATOL = 1e-4  # fp32 kernels of two versions round apart by ~1e-6; a wrong RoPE base is O(1)
# Runs in either environment: only torch and transformers, whatever their versions.
PROBE = r"""
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
c = model.config
theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta")
ids = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    logits = model(input_ids=out).logits[0].float()
print(json.dumps({"version": transformers.__version__, "tokenizer": type(tok).__name__, "rope_theta": theta,
                  "prompt_ids": ids[0].tolist(), "answer": out[0, ids.shape[1]:].tolist(),
                  "logits": logits.tolist()}))
"""


def logits_gap(a: list, b: list) -> float:
    """The largest absolute difference of two [positions, vocab] logit lists (inf when their shapes differ)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return math.inf
    return max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y)), default=0.0)


def probe(python: str, folder: Path, prompt: str, tokens: int) -> dict:
    """What `python`'s transformers reads from `folder`; RuntimeError with the side's last error line."""
    done = subprocess.run([python, "-c", PROBE, str(folder), prompt, str(tokens)], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit code " + str(done.returncode)])[-1]
        raise RuntimeError(f"{python} cannot load {folder}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--python", required=True, help="the other environment's python (another transformers)")
    parser.add_argument("--prompt", default="the cat")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if not (args.folder / "config.json").is_file():
        print(f"check_other_transformers: {args.folder} has no config.json; give an exported folder", file=sys.stderr)
        return 2
    try:
        here = probe(sys.executable, args.folder, args.prompt, args.tokens)
        there = probe(args.python, args.folder, args.prompt, args.tokens)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        print(f"check_other_transformers: {error}", file=sys.stderr)
        return 2
    gap = logits_gap(here["logits"], there["logits"])
    same = all(here[k] == there[k] for k in ("rope_theta", "prompt_ids", "answer")) and gap <= LOGITS_ATOL
    for side in (here, there):
        print(f"transformers {side['version']}: {side['tokenizer']}, rope_theta {side['rope_theta']}, "
              f"answer {side['answer']}")
    print(f"logits of the prompt and answer differ by at most {gap:.3g}")
    print("same answer" if same else "DIFFERENT: the folder does not load alike on both versions")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
