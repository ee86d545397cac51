#!/usr/bin/env bash
# The training steps around a checkpoint save (docs/benchmarks.md, "Sharded checkpoints"): the LM on 2
# workers, 41 steps, a save every 10 steps, with full, sharded and background (async) checkpoints; then the
# median of the two steps after each save against the other steps. Run from the repository root:
#   bench/around_save.sh [OUT_DIR]          (default bench-out/around-save)
set -euo pipefail
out=${1:-bench-out/around-save}
for mode in none sharded async; do
  rm -rf "$out/$mode"
  extra=()
  [ "$mode" != none ] && extra=(--set "checkpoint.$mode=true")
  .venv/bin/ringtrain train configs/text_lm.toml --nproc 2 --run-dir "$out/$mode" --set train.max_steps=41 \
    --set checkpoint.every_steps=10 --set monitor.log_every_steps=1 --set monitor.progress=false \
    --set monitor.eval_every_epochs=0 "${extra[@]}" > "$out/$mode.log" 2>&1
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
for mode in ("none", "sharded", "async"):
    records = [json.loads(line) for line in open(f"{sys.argv[1]}/{mode}/metrics.jsonl")]
    steps = {r["step"]: r["step_time_s"] for r in records if r["type"] == "train"}
    after = [s for s in steps if s > 10 and s % 10 in (1, 2)]
    others = [s for s in steps if s > 5 and s % 10 not in (1, 2)]
    a, o = statistics.median(steps[s] for s in after), statistics.median(steps[s] for s in others)
    saves = [(r["step"], round(r["blocked_s"] * 1e3, 1), round(r["background_s"] * 1e3, 1)) for r in records if r["type"] == "checkpoint"]
    print(f"{mode}: steps after a save {a * 1e3:.0f} ms, other steps {o * 1e3:.0f} ms, ratio {a / o:.3f}; saves (step, blocked ms, background ms): {saves}")
PY
