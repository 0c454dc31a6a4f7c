"""Measure resident memory of the data path on a large JSONL file (issue 11: larger than memory).

    python scripts/bench/data_memory.py [--mb 200] [--dir /tmp/sluice-data-memory] [--steps 200]

Writes a MiniMind-style pretraining JSONL of at least --mb megabytes and a tokenizer, then in fresh processes:
(1) builds the token cache (as scripts/prepare_data.py does), (2) streams --steps training steps of a
dp=2 replica from the memory-mapped cache. Prints peak RSS, and RSS (total, anonymous, file-backed) after the imports and at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, time
sys.path.insert(0, {repo!r})
from tests.data_helpers import data_section, make_cfg
from training.data import build_data
path, tokenizer, cache, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = make_cfg(data_section(name="jsonl", path=path, tokenizer=tokenizer, format="packed", cache_dir=cache),
               seq_len=256, micro_batch_size=8, n_microbatches=4)
def rss_mb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {{k: int(status[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}}
baseline = rss_mb()  # python + torch + transformers imported, no data yet
start = time.time()
stream, _ = build_data(cfg, 0, 2, verbose=False)
for _ in range(steps):
    next(stream)
print(json.dumps({{"seconds": round(time.time() - start, 1), "samples": len(stream.samples),
                  "peak_rss_mb": rss_mb()["VmHWM"],  # not ru_maxrss: it survives exec (the launcher's memory)
                  "baseline_mb": baseline, "end_mb": rss_mb()}}))
"""


def write_inputs(folder: Path, megabytes: int) -> tuple[Path, Path]:
    """A JSONL of synthetic documents (varied seeds) of at least `megabytes`, and a tokenizer trained on some."""
    sys.path.insert(0, str(REPO))
    from training.data import synthetic_corpus, train_bpe_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    path, tokenizer = folder / "big.jsonl", folder / "tokenizer"
    if not tokenizer.exists():
        train_bpe_tokenizer(synthetic_corpus(4000, seed=0), 2048).save_pretrained(tokenizer)
    if not path.exists() or path.stat().st_size < megabytes << 20:
        with open(path, "w") as f:
            seed = 0
            while f.tell() < megabytes << 20:
                f.write("".join(json.dumps({"text": t}) + "\n" for t in synthetic_corpus(2000, seed)))
                seed += 1
    return path, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/sluice-data-memory"))
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    path, tokenizer = write_inputs(args.dir, args.mb)
    print(f"file: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    for label, steps in (("build the cache + 1 step", 1), (f"cached: {args.steps} steps", args.steps)):
        start = time.time()
        result = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO)), str(path), str(tokenizer),
                                 str(args.dir / "cache"), str(steps)], capture_output=True, text=True, cwd=REPO)
        if result.returncode:
            sys.exit(result.stderr[-3000:])
        print(f"{label}: {result.stdout.strip()} (wall {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
