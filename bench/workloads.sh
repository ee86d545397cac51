#!/usr/bin/env bash
# The runs behind docs/workloads.md's numbers: ResNet-18 on the digits and the byte-level Transformer
# LM, each on 2 CPU workers. Run it on a quiet machine (other processes on the cores slow every number):
#   bench/workloads.sh [digits_resnet|text_lm ...]
# Each run writes runs/<config>-<date>/ (metrics.jsonl, summary.json); the last lines print the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
export OMP_NUM_THREADS=1
stamp=$(date +%Y%m%d-%H%M%S)
for name in "${@:-digits_resnet text_lm}"; do
  for job in $name; do
    run_dir="runs/$job-$stamp"
    # python -m from the repo root runs this checkout's code (an installed console script may not).
    "$BIN/python" -m ringtrain train "configs/$job.toml" --nproc 2 --run-dir "$run_dir" --set monitor.progress=false
    "$BIN/python" - "$run_dir" <<'PY'
import json, sys
run = sys.argv[1]
s = json.load(open(f"{run}/summary.json"))
e = s["eval"]
line = f"{run}: {s['steps']} steps, {s['wall_s'] / 60:.1f} min of training, {s['samples_per_s']:.0f} samples/s"
if "accuracy" in e:
    line += f", test accuracy {e['accuracy']:.2%} (top-5 {e['top5_accuracy']:.2%})"
else:
    d = s["data"]
    line += (f", {s['tokens_per_s']:.0f} tokens/s, MFU {s.get('mfu', float('nan')):.1%}, val loss {e['loss']:.3f} "
             f"nats/byte (ppl {e['ppl']:.2f}) vs unigram entropy {d['unigram_entropy_nats']:.3f}")
print(line)
PY
  done
done
