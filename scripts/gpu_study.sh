#!/usr/bin/env bash
# Run a study plan on every GPU of this machine, several worker processes per GPU, within a
# fixed wall time; then pack what finished into parts of at most 15 MiB (OUTDIR/study_runs.
# tar.gz.partNN: `cat` them and unpack into the plan's out_dir, then `linattn study --plan P
# --aggregate-only`). Each worker starts a run group only if it should end in time
# (--deadline), and is killed at the limit; an interrupted run resumes if this machine is
# still there for the next call. The workers balance the groups not yet finished at their launch
# (--pending-before).
# DONE_ARCHIVE (optional): a `linattn study --markers` archive
# of the groups finished on earlier machines, so they are skipped here (a marked run whose
# configuration differs from the plan's, say a final run whose arm's choice moved, trains).
# PARTIAL_ARCHIVE (optional): the parts (a glob, e.g. DIR/partial_runs.tar.gz.part*) of a
# --pack-partial archive an earlier call wrote: the run groups it killed, restored whole so they
# resume here (`linattn study --restore-partial`; a group this machine trained is kept).
# At the end, besides the finished runs (the tuning runs too where both stages ran),
# OUTDIR/partial_runs.tar.gz.partNN archives the groups still unfinished (whole, checkpoints
# included), if any, and OUTDIR/choices.json is the tuning's choice, if made: carry them to the
# next machine (the choice as --choices, so a restore there knows the final runs).
# Archives an earlier call left in OUTDIR are removed once PARTIAL_ARCHIVE is restored.
# PACK_NEW_ONLY=1 (with DONE_ARCHIVE): the packed runs leave out those DONE_ARCHIVE holds with
# the same summary.json (`linattn study --pack-except`): on a machine kept warm between calls,
# what an earlier call trained and packed does not come back twice.
# PACK_PARTIAL=0: no archive of the unfinished groups (they hold every checkpoint, often far
# larger than the finished runs; where what comes back from the machine is bounded, the
# finished runs then come back whole, and the unfinished groups train again elsewhere).
# Packing takes time after SECONDS (tens of seconds for large partial groups): a caller's own
# time limit needs that margin.
# PROFILE_ARGS (optional, e.g. "--profile-steps 4000 --profile-batch-size 128"): after the
# workers, the kernel profile of the selection's cells (`linattn study --profile`) on every GPU,
# one process each (--shard k/ngpu of the cells), for PROFILE_SECONDS (default 0: none) of the
# SECONDS, the workers getting the rest; a process starts no new cell after half its time. The
# cache of every Phi computed goes to OUTDIR/profiles.tar.gz.partNN (`cat` the parts and unpack
# the archive into the plan's out_dir); then `linattn study --plan P --profile PROFILE_ARGS
# --aggregate-only` writes the tables.
# A stack the limit kills leaves its progress (partial_<digest>.pt, saved every 60 s) in that
# cache, so the archive carries it too: unpacked into the plan's out_dir on the next machine,
# the same PROFILE_ARGS resume the stack where it was.
# With "--profile-split kernels" in PROFILE_ARGS the GPUs share every cell instead (each the
# k-th of every ngpu kernels): for fewer cells than GPUs, or a budget one GPU cannot end in time.
# A cell is profiled from the snapshots on this machine, so its runs train here first.
# NO_DEADLINE=1: the workers start every group of their shard, with no --deadline (for groups
# longer than one call: the limit kills them, and the next call resumes them on this machine
# if it is still warm, or from the partial archive, PARTIAL_ARCHIVE).
# A worker whose CUDA context is lost (exit 3, `linattn study` after a device-side assert)
# starts again in a new process while more than a minute is left, its runs resuming from their
# checkpoints: at most MAX_RESTARTS times (default 3), and not when the process lost it within
# FAST_LOSS_S seconds (default 30) of its start (a context lost at once is lost again on every
# restart: a broken device, not a broken run).
# Each worker (--shard k/n) takes the machine's cores divided by the n workers as its CPU
# threads (`linattn study --threads`); OMP_NUM_THREADS, when set, decides instead. Each
# worker's runs record WORKERS_PER_GPU as the processes that shared their GPU
# (LINATTN_DEVICE_WORKERS, summary.json device.workers), so `--estimate` prices GPU seconds.
# Usage: bash scripts/gpu_study.sh PLAN SECONDS WORKERS_PER_GPU OUTDIR [study options]
# The study options (--stage, --slice, --choices, ...) select what the workers train and what is
# listed, packed and marked at the end: `--stage final --slice 'sweep/*/alpha=0.1/*'` packs that
# slice's final runs.
# Data: LINATTN_DATA must point at a folder holding the packed data sets (`linattn data pack`).
set -uo pipefail
plan=${1:?usage: gpu_study.sh PLAN SECONDS WORKERS_PER_GPU OUTDIR [--slice GLOB ...]}
seconds=${2:?seconds}; per_gpu=${3:?workers per gpu}; out=${4:?outdir}; shift 4
for var in MAX_RESTARTS FAST_LOSS_S; do
  if [ -n "${!var:-}" ] && ! [[ ${!var} =~ ^[0-9]+$ ]]; then
    echo "$var=${!var}: a whole number of restarts or seconds, e.g. $var=3" >&2; exit 2
  fi
done
mkdir -p "$out/logs"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -lt 1 ]; then echo "no GPU listed by nvidia-smi -L"; exit 1; fi
workers=$((ngpu * per_gpu))
start=$(date +%s)
if [ -n "${DONE_ARCHIVE:-}" ]; then
  dest=$(python -c "from real_data import study; print(study.load_plan('$plan').out_dir)")
  mkdir -p "$dest" && tar -xzf "$DONE_ARCHIVE" -C "$dest" || exit 1
fi
if [ -n "${PARTIAL_ARCHIVE:-}" ]; then
  # shellcheck disable=SC2086  # the glob names the parts, in order
  cat $PARTIAL_ARCHIVE > "$out/restore.tar.gz" || exit 1
  python -m linattn study --plan "$plan" --restore-partial "$out/restore.tar.gz" "$@" || exit 1
  rm -f "$out/restore.tar.gz"
fi
# what an earlier call packed into this OUTDIR describes that call, not this one
rm -f "$out"/study_runs.tar.gz* "$out"/partial_runs.tar.gz* "$out"/profiles.tar.gz* \
  "$out/done_markers.tar.gz" "$out/logs.tar.gz"
# the pretraining jobs the selection needs, spread over the GPUs (the k-th of every ngpu jobs)
# (killed well before the call's limit, so the markers of what exists still get written)
pids=()
for ((k = 0; k < ngpu; k++)); do
  CUDA_VISIBLE_DEVICES=$k timeout -s KILL "$((seconds / 2))" \
    python -m linattn study --plan "$plan" --pretrain-only \
    --shard "$k/$ngpu" "$@" > "$out/logs/pretrain_$k.log" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
cat "$out"/logs/pretrain_*.log
if [ "$fail" -ne 0 ]; then
  echo "pretraining failed: see $out/logs/pretrain_*.log"
  python -m linattn study --plan "$plan" --aggregate-only --no-tables \
    --markers "$out/done_markers.tar.gz" "$@" | tail -1
  tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
  exit 1
fi
profile_s=0
if [ -n "${PROFILE_ARGS:-}" ]; then profile_s=${PROFILE_SECONDS:-0}; fi
left=$((seconds - profile_s - ($(date +%s) - start)))
if [ "$left" -le 30 ]; then echo "no time left for workers after pretraining"; workers=0; fi
launch=$(date +%s)  # what finished before this is what every worker counts as finished
# a worker whose GPU context is lost (exit 3): restarted as the header says
max_restarts=${MAX_RESTARTS:-3}
fast_loss_s=${FAST_LOSS_S:-30}
worker() {
  local k=$1 rest rc began restarts=0 deadline
  shift
  : > "$out/logs/worker_$k.log"
  while :; do
    began=$(date +%s)
    rest=$((left - (began - launch)))
    deadline=(--deadline "$((rest - 20))")
    if [ "${NO_DEADLINE:-0}" = 1 ]; then deadline=(); fi
    CUDA_VISIBLE_DEVICES=$((k % ngpu)) LINATTN_DEVICE_WORKERS=$per_gpu timeout -s KILL "$rest" \
      python -m linattn study --plan "$plan" --shard "$k/$workers" --pending-before "$launch" \
      ${deadline[@]+"${deadline[@]}"} --no-tables "$@" >> "$out/logs/worker_$k.log" 2>&1
    rc=$?
    if [ "$rc" -ne 3 ] || [ $((left - ($(date +%s) - launch))) -le 60 ]; then return "$rc"; fi
    if [ $(($(date +%s) - began)) -lt "$fast_loss_s" ]; then
      echo "worker $k: the GPU context was lost within $fast_loss_s s of the process's start" \
        "(exit 3, after $restarts restarts); it stops" | tee -a "$out/logs/worker_$k.log"
      return "$rc"
    fi
    if [ "$restarts" -ge "$max_restarts" ]; then
      echo "worker $k: the GPU context was lost again (exit 3, after $restarts restarts);" \
        "it stops" | tee -a "$out/logs/worker_$k.log"
      return "$rc"
    fi
    restarts=$((restarts + 1))
    echo "worker $k: the GPU context was lost (exit 3); a new process resumes its runs" \
      | tee -a "$out/logs/worker_$k.log"
  done
}
wpids=()
for ((k = 0; k < workers; k++)); do
  worker "$k" "$@" &
  wpids+=($!)
done
( while sleep 60; do nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader; done ) \
  > "$out/logs/utilization.log" 2>&1 &
monitor=$!
for p in "${wpids[@]}"; do wait "$p"; done
kill "$monitor" 2>/dev/null
echo "workers stopped after $(($(date +%s) - start)) s"
if [ "$profile_s" -gt 0 ]; then
  ppids=()
  for ((k = 0; k < ngpu; k++)); do
    # shellcheck disable=SC2086  # PROFILE_ARGS holds several options
    CUDA_VISIBLE_DEVICES=$k timeout -s KILL "$profile_s" \
      python -m linattn study --plan "$plan" --profile $PROFILE_ARGS --shard "$k/$ngpu" \
      --deadline "$((profile_s / 2))" --no-tables "$@" > "$out/logs/profile_$k.log" 2>&1 &
    ppids+=($!)
  done
  for ((k = 0; k < ngpu; k++)); do
    wait "${ppids[$k]}" || { echo "profile on GPU $k failed:"; tail -3 "$out/logs/profile_$k.log"; }
  done
  grep -h "^profile " "$out"/logs/profile_*.log | tail -5
  dest=$(python -c "from real_data import study; print(study.load_plan('$plan').out_dir)")
  if [ -d "$dest/profiles" ]; then
    tar -czf "$out/profiles.tar.gz" -C "$dest" profiles
    split -b 15M -d "$out/profiles.tar.gz" "$out/profiles.tar.gz.part" && rm "$out/profiles.tar.gz"
  fi
  echo "profiles stopped after $(($(date +%s) - start)) s"
fi
python -m linattn study --plan "$plan" --list "$@" | awk '{print $1}' | sort | uniq -c
partial=(--pack-partial "$out/partial_runs.tar.gz")
if [ "${PACK_PARTIAL:-1}" = 0 ]; then partial=(); fi
except=()
if [ "${PACK_NEW_ONLY:-0}" = 1 ] && [ -n "${DONE_ARCHIVE:-}" ]; then
  except=(--pack-except "$DONE_ARCHIVE")
fi
python -m linattn study --plan "$plan" --aggregate-only --no-tables \
  --pack "$out/study_runs.tar.gz" ${partial[@]+"${partial[@]}"} ${except[@]+"${except[@]}"} \
  --markers "$out/done_markers.tar.gz" "$@" | tail -3
split -b 15M -d "$out/study_runs.tar.gz" "$out/study_runs.tar.gz.part" && rm "$out/study_runs.tar.gz"
if [ -n "$(tar -tzf "$out/partial_runs.tar.gz" 2>/dev/null | head -n 1)" ]; then
  split -b 15M -d "$out/partial_runs.tar.gz" "$out/partial_runs.tar.gz.part"
fi
rm -f "$out/partial_runs.tar.gz"
# the configurations a tuning stage chose: a later machine's final stage takes them with
# --choices (and can then restore the final runs of a partial archive before any tuning)
dest=$(python -c "from real_data import study; print(study.load_plan('$plan').out_dir)")
if [ -f "$dest/choices.json" ]; then cp "$dest/choices.json" "$out/choices.json"; fi
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
ls -la "$out"
# a device that returns a bounded number of files and bytes drops what exceeds them; the
# finished runs first, then the partial groups (large: their checkpoints) are what to keep
echo "OUTDIR holds $(find "$out" -type f | wc -l) files, $(du -sm "$out" | cut -f1) MiB"
