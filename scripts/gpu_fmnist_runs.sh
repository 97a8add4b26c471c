#!/usr/bin/env bash
# The one-GPU record of docs/results/real_data_study.md: fmnist_vit (50 clients, Dirichlet
# 0.3), 100 rounds of FedAvg and FedFrozen (T0 = 20, both training variants). Usage: bash scripts/gpu_fmnist_runs.sh OUTDIR
# Data: LINATTN_DATA must point at a folder holding fmnist/ (e.g. `linattn data pack fmnist --to .data`).
set -euo pipefail
out=${1:?usage: gpu_fmnist_runs.sh OUTDIR}
runs=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for arm in "fedavg algorithm.name=fedavg" "fedfrozen_all_but_qk algorithm.name=fedfrozen algorithm.train=all_but_qk" \
           "fedfrozen_v algorithm.name=fedfrozen algorithm.train=v"; do
  set -- $arm
  name=$1; shift
  python -m linattn run --config fmnist_vit --out "$runs/$name" run.progress=false run.plot=false \
      run.checkpoint_every=50 "$@"
  cp "$runs/$name/summary.json" "$out/$name.summary.json"
  cp "$runs/$name/metrics.csv" "$out/$name.metrics.csv"
done
