#!/usr/bin/env bash
# Short runs of megamoe-train recipes without checkpoints, e.g. the GPU proxy recipes on an H200 node:
#
#   bash scripts/cli_smoke.sh STEPS RECIPE.yaml [RECIPE.yaml ...]
#
# Per recipe: RESULTS/<name>.log (the progress lines) and RESULTS/<name>.metrics.jsonl, where
# RESULTS is $OUT if set, else runs/smoke. Each run is cut off after $SMOKE_TIMEOUT seconds (300).
# On a machine without a package index (megatron-core not installed), copy megatron-core (pure
# Python), psutil and pyyaml out of a Python 3.12 venv and put them on PYTHONPATH:
#   mkdir -p build/site && cp -r $VENV/lib/python3.12/site-packages/{megatron,psutil,yaml} build/site/
#   PYTHONPATH=$PWD/build/site:$PWD bash scripts/cli_smoke.sh 8 recipes/qwen3_30b_a3b_proxy_2gpu_bf16.yaml
set -uo pipefail
cd "$(dirname "$0")/.."
steps=$1; shift
results=${OUT:-runs/smoke}
mkdir -p "$results"
python=${PYTHON:-python3}
status=0
for recipe in "$@"; do
  name=$(basename "$recipe" .yaml)
  start=$(date +%s)
  timeout "${SMOKE_TIMEOUT:-300}" "$python" -m megamoe_trainer "$recipe" --steps "$steps" --no-resume \
    --set run.log_every=1 --set run.plot_every=0 --set run.checkpoint=false --run-dir "runs/smoke/$name" \
    > "$results/$name.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  cp "runs/smoke/$name/metrics.jsonl" "$results/$name.metrics.jsonl" 2>/dev/null
  echo "$name: exit $rc, $(( $(date +%s) - start )) s; $(grep -E '^step' "$results/$name.log" | tail -1)"
done
exit $status
