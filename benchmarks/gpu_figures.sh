#!/usr/bin/env bash
# The device check for issue 18 (and 19's MAE cost): one prepared run on a lent GPU, at most ~9.7 minutes (the sum of its parts' limits).
#   bash benchmarks/gpu_figures.sh            # writes $OUT/*.json (or ./gpu-figures/) and prints a summary
# Each part has its own time limit, and one part failing never stops the next.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-figures}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv;
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])";
  python3 -c "import timm; print('timm', timm.__version__)"; python3 -c "import transformers as t; print('transformers', t.__version__)"; } \
  2>&1 | tee "$out/machine.txt"

part() {  # part NAME SECONDS CMD...: run one benchmark, its JSON to $out/NAME.json, its log to $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.json" 2> "$out/$name.log"
  echo "== $name: rc=$? in $(( $(date +%s) - t0 )) s"
  tail -c 1500 "$out/$name.json"; echo
}

# §1: the training step, ours against timm and Hugging Face, eager and compiled, with the measured peak and MFU.
part train_step 290 python3 benchmarks/vit_train_step.py --device cuda --compile both \
  --variant cudnn-attention --variant bf16-master --json
# §3: Longformer attention alone: banded, flex (dilation 1 and 2, globals merged or as a prefix), plain
# sliding-window flex, flash; the agreement check compiles both layouts first, hence the longer budget.
part longformer 200 python3 benchmarks/longformer_attention.py --device cuda --budget-s 150 --json
# Issue 19 §3: the MAE step against a supervised step of the same ViT-B/16.
part mae_step 90 python3 benchmarks/vit_train_step.py --objective mae --device cuda --json
