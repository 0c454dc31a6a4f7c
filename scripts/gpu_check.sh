#!/usr/bin/env bash
# GPU check, ready to run on a CUDA machine (skipped elsewhere): bf16 equivalence of a split layout against
# one process, one traced step, and a short MiniMind-3 (64M) bf16 run that prints its MFU.
#   bash scripts/gpu_check.sh            # outputs under gpu_check_out/ (OUT=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-gpu_check_out}

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device on this machine; skipped"
    exit 0
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 4 ]; then LAYOUT=(parallel.tp=2 parallel.pp=2); WORKERS=4
elif [ "$NGPU" -ge 2 ]; then LAYOUT=(parallel.pp=2); WORKERS=2
else LAYOUT=(parallel.pp=2 parallel.emulate=true); WORKERS=1
fi
rm -rf "$OUT"
COMMON=(model=tiny train.steps=6 train.dtype=bf16 optim.warmup_steps=0 optim.lr=1e-3 logger=none
        train.log_every=1 data.num_docs=400 "data.cache_dir=$OUT/cache")

echo "gpu_check: $NGPU GPU(s); layout ${LAYOUT[*]} on $WORKERS worker(s), bf16, against one process"
"$PY" train.py "${COMMON[@]}" "hydra.run.dir=$OUT/single"
"$PY" -m torch.distributed.run --nproc-per-node "$WORKERS" train.py "${COMMON[@]}" "${LAYOUT[@]}" \
    train.trace_step=3 "hydra.run.dir=$OUT/layout"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
read = lambda run: [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
single, layout = read("single"), read("layout")
worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(layout, single))
print(f"gpu_check: bf16 losses, layout vs one process: worst relative difference {worst:.2e} over {len(single)} steps")
assert (out / "layout" / "trace_step3.json").exists(), "the traced step wrote no Chrome trace"
print(f"gpu_check: traced step: {out / 'layout' / 'trace_step3.json'} and .png; "
      f"measured bubble {[r for r in layout if 'bubble_fraction' in r][0]['bubble_fraction']:.1%}")
# bf16 rounds differently when the matmuls are split (TP) or fused differently: the same order as one-process
# bf16 against fp32, far below the factor-level errors of a wrong scale.
sys.exit(0 if worst < 2e-2 else 1)
PY

echo "gpu_check: MiniMind-3 (64M), bf16, one GPU"
"$PY" train.py model=minimind3 train.steps=30 train.dtype=bf16 train.micro_batch_size=16 train.seq_len=512 \
    schedule.n_microbatches=2 logger=none train.log_every=10 "data.cache_dir=$OUT/cache" \
    "hydra.run.dir=$OUT/minimind3"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

last = [json.loads(line) for line in (Path(sys.argv[1]) / "minimind3" / "metrics.jsonl").read_text().splitlines()][-1]
mfu = last.get("mfu")
print(f"gpu_check: MiniMind-3 bf16: {last['tokens_per_s']:.0f} tokens/s, {last.get('tflops', 0):.1f} TFLOP/s, "
      f"MFU {'n/a (unknown GPU peak: set train.peak_tflops)' if mfu is None else f'{mfu:.1%}'}, "
      f"peak memory {last.get('peak_mem_bytes', 0) / 2**30:.2f} GiB")
PY
