"""``linattn run | sweep | bench | study | data | pretrain | profile``: the real-data commands.

``linattn.cli`` routes here with ``argv[0]`` the subcommand. Bad input raises
:class:`~linattn.errors.UserError` (exit 2 through the router); a diverged run exits 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="linattn run",
        description="One federated run on real data from a YAML config. It writes a run "
        "directory (config, partition, metrics.csv, summary.json, curves.png, checkpoints) and "
        "prints the last and the best test accuracy.")
    ap.add_argument("--config", help="YAML file or shipped config name (e.g. digits_vit)")
    ap.add_argument("--out", type=Path,
                    help="run directory (default: <run.out_dir>/<name with the settings>, "
                    "run.out_dir being runs under the current directory)")
    ap.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a killed run")
    ap.add_argument("--distributed", action="store_true",
                    help="under torchrun: shard each round's clients over the processes")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted config overrides, e.g. train.lr=0.05 train.rounds=50")
    args = ap.parse_args(argv)
    from linattn.errors import UserError
    from real_data.runs import resume_run, start_run

    cfg = None
    if args.resume is not None:
        if args.config or args.overrides or args.out:
            raise UserError("--resume takes only the run directory (its config.yaml is used)")
    else:
        if not args.config:
            raise UserError("linattn run needs --config (or --resume RUN_DIR)")
        from real_data.config import load_config

        cfg = load_config(args.config, args.overrides)
    if args.distributed:
        from real_data.distributed import run_distributed

        result = run_distributed(cfg, out=args.out, resume=args.resume)
        if result is None:  # not rank 0: rank 0 writes and reports
            return 0
    elif args.resume is not None:
        result = resume_run(args.resume)
    else:
        result = start_run(cfg, out=args.out)
    return _report(result)


def _report(result) -> int:
    if result.status != "completed":
        print(f"run stopped: {result.message}\nrun directory: {result.run_dir}", file=sys.stderr)
        return 1
    print(f"{result.run_dir}: {result.rounds_completed} rounds{_accuracy(result.summary)}")
    return 0


def _accuracy(summary: dict) -> str:
    """', test_acc last L, best B (round R)' from a run summary, or '' without test_acc."""
    last = summary.get("final", {}).get("test_acc")
    if last is None:
        return ""
    best = summary.get("best", {}).get("test_acc", {})
    tail = f", best {best['value']:.4f} (round {best['round']})" if best else ""
    return f", test_acc last {last:.4f}{tail}"


def _sweep(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="linattn sweep",
        description="A grid of federated runs (algorithms x seeds x Dirichlet alphas x "
        "FedFrozen T0) that share the data and branch the T0 runs from one warm-up run's "
        "checkpoints; sweep.csv indexes them.")
    ap.add_argument("--config", required=True,
                    help="YAML file or shipped config name (e.g. digits_vit)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the runs")
    ap.add_argument("--algorithms", type=_names, default=[],
                    help="comma list of algorithms (default: the config's)")
    ap.add_argument("--seeds", type=_ints, default=[],
                    help="comma list of seeds (default: the config's)")
    ap.add_argument("--warmup-rounds", type=_ints, default=[],
                    help="comma list of FedFrozen warm-up lengths T0 (default: the config's)")
    ap.add_argument("--alphas", type=_floats, default=[],
                    help="comma list of Dirichlet alphas (default: the config's partition.alpha)")
    ap.add_argument("--no-stack", action="store_true",
                    help="train the runs one after another instead of in stacked groups "
                    "(same results up to rounding; stacking shares each round's engine call)")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted config overrides, e.g. train.rounds=50")
    args = ap.parse_args(argv)
    from real_data.config import load_config
    from real_data.sweep import run_sweep

    results = run_sweep(load_config(args.config, args.overrides), args.out, args.algorithms,
                        args.seeds, args.warmup_rounds, args.alphas, stack=not args.no_stack)
    for r in results:
        print(f"{r.status:9s} {r.run_dir}{_accuracy(r.summary)}")
    return 0 if all(r.status == "completed" for r in results) else 1


def _pretrain(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="linattn pretrain",
        description="Train a run config's model centrally on a source data set (FedSQ's S).")
    ap.add_argument("--config", required=True, help="run config whose model is pretrained")
    ap.add_argument("--source", required=True, help="source data set (e.g. mnist)")
    ap.add_argument("--out", type=Path, required=True, help="file to write (.pt)")
    ap.add_argument("--source-skip", type=int, default=0,
                    help="drop the first N source training samples (disjoint split)")
    ap.add_argument("--source-limit", type=int, default=None, help="then keep at most N")
    ap.add_argument("--epochs", type=int, default=3, help="passes over the source (default 3)")
    ap.add_argument("--batch-size", type=int, default=64, help="minibatch size (default 64)")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam step size (default 0.001)")
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="Adam weight decay (default 0)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the initial weights and the minibatch order (default 0)")
    ap.add_argument("--exclude-largest-groups", type=int, default=0, metavar="N",
                    help="natural-client data: leave out the N largest groups (the clients "
                    "of a natural partition with num_clients=N)")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted overrides of the run config (model.*, train.device, ...)")
    args = ap.parse_args(argv)
    from linattn.errors import UserError
    from real_data.config import load_config
    from real_data.pretrain import PretrainSettings, run_pretrain

    if args.out.exists():
        raise UserError(f"{args.out} already exists; choose another --out")
    settings = PretrainSettings(args.source, args.source_skip, args.source_limit, args.epochs,
                                args.batch_size, args.lr, args.weight_decay, args.seed,
                                args.exclude_largest_groups)
    meta = run_pretrain(load_config(args.config, args.overrides), settings, args.out)
    print(f"{args.out}: {meta['source']} ({meta['samples']} samples, {args.epochs} epochs), "
          f"source test_acc {meta['source_test_acc']:.4f}")
    return 0


def study_threads(threads: int | None, shard: tuple[int, int] | None,
                  cores: int | None = None) -> int | None:
    """The CPU threads a study worker sets (``None``: leave torch's own): ``--threads`` when
    given (at least 1, else a UserError naming it); else none where ``OMP_NUM_THREADS`` is
    set; else, for ``--shard k/n``, the cores divided by n, since n workers side by side
    would each start one thread per core and oversubscribe them n times over."""
    import os

    from linattn.errors import UserError

    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads {threads}: must be >= 1")
        return threads
    if os.environ.get("OMP_NUM_THREADS") or shard is None:
        return None
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    return max(1, cores // shard[1])


TUNING_POLL_S = 10.0  # how often a worker waiting for other workers' tuning runs looks again
# looks in a row, after the first that finds no worker tuning, before a waiting worker gives
# up (a worker holds no lock while it starts, loads data or prepares its next group)
TUNING_GRACE_POLLS = 3
# a worker that has seen no tuning in progress gives those looks only this early in its call,
# while the other workers may still be starting
TUNING_START_S = 60.0


def _pause(seconds: float) -> None:
    time.sleep(seconds)


def _left(deadline: float, since: float) -> float:
    """Seconds of ``deadline`` (counted from ``since``, a ``time.monotonic()``) still left."""
    return deadline - (time.monotonic() - since)


def _tuning_in_progress(full, arms: set | None = None) -> bool:
    """Whether a live process (another worker) holds an unfinished tuning run of ``full`` (of
    the (sweep, arm) pairs in ``arms`` where given)."""
    from real_data import study
    from real_data.lock import holder

    return any(study.run_status(s.run_dir) not in study.FINAL and holder(s.run_dir)
               for s in study.tuning_runs(full, arms))


def _study(argv: list[str]) -> int:
    import argparse
    from pathlib import Path

    from linattn.errors import ConfigError, UserError
    from real_data import study
    from real_data.study.difficulty import write_difficulty

    ap = argparse.ArgumentParser(
        prog="linattn study",
        description="The real-data validation study: a plan of sweeps, run resumably in "
        "slices, then aggregated into tables.",
        epilog="Exit status: 0 done; 1 some run failed (FAILED lines); 2 a bad plan, option or "
        "file; 3 the GPU's context became unusable (a device-side assert: every later run of "
        "the process would fail), so the process stopped and a new one resumes its runs. "
        "Environment: LINATTN_DATA, the data cache root; LINATTN_DEVICE_WORKERS, the "
        "processes sharing this GPU (recorded in each run; --deadline prices at it); "
        "LINATTN_STACK_PAD=group|live, an eager stacked group's engine calls padded to its "
        "largest membership (default) or to each round's runs.")
    ap.add_argument("--plan", required=True, help="plan YAML, or the name of a shipped plan")
    ap.add_argument("--out", type=Path,
                    help="folder of the study's runs (default: the plan's out_dir, relative "
                    "to the current directory)")
    ap.add_argument("--slice", action="append",
                    help="glob over <sweep>/<arm>/alpha=<a>/seed=<s> (quote it; repeat the "
                    "option for a union)")
    ap.add_argument("--max-runs", type=int, help="start or resume at most this many run groups")
    ap.add_argument("--budget", type=float, help="start no new run after this many seconds")
    ap.add_argument("--deadline", type=float, metavar="SECONDS",
                    help="start a run group only if, at the pace of the groups run so far, it "
                    "ends within SECONDS of the call's start, both stages together (for "
                    "time-limited GPU calls); a worker whose tuning runs are done waits for "
                    "those other workers still train, then takes its share of the final runs")
    ap.add_argument("--shard", help="k/n: run the k-th (0-based) of n cost-balanced parts of "
                    "the selection (n workers side by side)")
    ap.add_argument("--threads", type=int, metavar="N",
                    help="CPU threads of this worker (torch.set_num_threads): data shifts, "
                    "partitions and CPU training run on them. Default: OMP_NUM_THREADS when "
                    "set; with --shard k/n, the machine's cores divided by n (n workers side "
                    "by side share them; more threads than cores slow every worker down); "
                    "else torch's own (all cores)")
    ap.add_argument("--pending", action="store_true",
                    help="run only the groups not yet finished and, with --shard, balance the "
                    "parts over them, weighed by measured seconds per round (all workers must "
                    "start together, e.g. on a fresh machine given --markers)")
    ap.add_argument("--pending-before", type=float, metavar="UNIX_TIME",
                    help="as --pending, counting as finished only runs finished before this "
                    "time, so workers started a few seconds apart agree on the split")
    ap.add_argument("--pretrain-only", action="store_true",
                    help="only run the plan's missing pretraining jobs the selection needs "
                    "(before starting several --shard workers; with --shard k/n, the k-th of "
                    "every n jobs, so one process per GPU pretrains side by side)")
    ap.add_argument("--aggregate-only", action="store_true", help="only write the tables")
    ap.add_argument("--export", type=Path, help="also copy the tables here (e.g. docs/study)")
    ap.add_argument("--pack", type=Path, metavar="FILE.tar.gz",
                    help="then archive the finished runs' global metrics and Q/K snapshots, "
                    "the tuning runs too where the stages ran together (small; unpack into "
                    "out_dir and --aggregate-only elsewhere)")
    ap.add_argument("--pack-except", type=Path, metavar="FILE.tar.gz",
                    help="with --pack: leave out the runs this --markers (or --pack) archive "
                    "holds with the same summary.json, the ones that came back before (on a "
                    "machine kept between calls, --pack then holds only the new runs)")
    ap.add_argument("--markers", type=Path, metavar="FILE.tar.gz",
                    help="write the summary.json and config.yaml of every finished run "
                    "group; unpacked into out_dir on a fresh machine, the study skips them (a "
                    "marked run whose configuration differs from the plan's trains again)")
    ap.add_argument("--pack-partial", type=Path, metavar="FILE.tar.gz",
                    help="then archive every started, unfinished run group whole (checkpoints "
                    "included), so another machine resumes it (--restore-partial) where a "
                    "killed call left it")
    ap.add_argument("--restore-partial", type=Path, metavar="FILE.tar.gz",
                    help="train nothing: put the run groups of a --pack-partial archive into "
                    "out_dir (a group this machine trained, or finished, is kept as it is); "
                    "the next call resumes them")
    ap.add_argument("--no-tables", action="store_true",
                    help="skip writing the tables (e.g. on a GPU host, before --pack)")
    ap.add_argument("--list", action="store_true",
                    help="list the plan's runs and their status; a final run that trains "
                    "exactly as another arm's run is listed as `same KEY = SOURCE`")
    ap.add_argument("--estimate", action="store_true",
                    help="print what the selection still costs per sweep: runs, run-rounds and "
                    "GPU seconds at the pace measured in the plan's finished GPU runs (unpack "
                    "a --markers archive into out_dir to price a fresh folder); trains nothing")
    ap.add_argument("--pace-from", metavar="PLAN", default=None,
                    help="with --estimate: where this plan has no finished GPU run, price it at "
                    "the pace per unit of local work measured in PLAN's runs")
    ap.add_argument("--pace-table", type=Path, metavar="study_per_run.csv",
                    help="with --pace-from: where PLAN's runs are not here, the per-run table "
                    "its --export wrote (e.g. docs/study/fair/study_per_run.csv) gives the "
                    "measured GPU paces")
    ap.add_argument("--pace-workers", type=int, metavar="N", default=1,
                    help="with --estimate: worker processes that shared each GPU in the "
                    "measured runs that do not record it (summary.json device.workers; "
                    "scripts/gpu_study.sh's WORKERS_PER_GPU); their wall pace over N is the "
                    "GPU's (default 1)")
    ap.add_argument("--no-stack", action="store_true",
                    help="train run groups one after another instead of stacking them "
                    "(stacked groups share each round's engine call; same results up to "
                    "rounding)")
    ap.add_argument("--stage", choices=("tune", "final"),
                    help="a plan with a tune section: only its tuning runs (every grid point "
                    "on the tuning seed, scored on validation; an arm with one candidate "
                    "takes none) or only its final runs (the "
                    "chosen configurations over every seed); default both, in order")
    ap.add_argument("--choices", type=Path, metavar="choices.json",
                    help="the final stage takes the chosen configurations from this file (the "
                    "choices.json a tuning stage wrote, or its exported copy) instead of the "
                    "tuning runs, which then need not be here; with --slice, the final stage "
                    "needs only the selected arms' tuning finished (or chosen in this file)")
    ap.add_argument("--profile", action="store_true",
                    help="train nothing: evaluate the kernel profile Phi (linattn profile) at "
                    "every T0 snapshot of each sweep's T0 arms and reference arms, under the T0 "
                    "family head's config, and write kernel_profile.{csv,json,md} (bias(T0) = "
                    "Phi(M_ref,T0) - Phi_best, drift(T0) = Phi(M_T0) - Phi(M_ref,T0) for each "
                    "reference arm; Phi_best: the pooled single-client reference's kernel at "
                    "its last snapshot) and t0_choice.{csv,md}; each Phi is cached under "
                    "out_dir/profiles, and a stack's progress every 60 s beside it, so a killed "
                    "call resumes; --slice keeps the (sweep, alpha, seed) cells one of whose "
                    "runs it matches, --shard k/n takes every n-th "
                    "cell (every n-th kernel of each cell with --profile-split kernels), "
                    "--deadline starts no new cell after SECONDS, "
                    "--aggregate-only only reads the cache")
    _budget_options(ap, "--profile-", "with --profile: ", "each run's")
    ap.add_argument("--profile-rounds", type=_ints, default=None, metavar="ROUNDS",
                    help="with --profile: only the kernels of these T0 (a comma list of rounds "
                    "of the plan's T0 grid, e.g. 0,40,120,200; Phi_best's kernel always): "
                    "bias and drift at fewer T0 for less GPU time; default every T0")
    ap.add_argument("--profile-split", default=None, metavar="WHAT",
                    help="with --profile and --shard k/n: cells (default: each process takes "
                    "whole cells, every n-th) or kernels (each process takes every n-th kernel "
                    "of every cell: n processes share a cell, each with a smaller stack; for "
                    "fewer cells than processes, or a budget too long for one process)")
    ap.add_argument("--device", default=None,
                    help="with --profile: where Phi trains (default: each run's train.device)")
    args = ap.parse_args(argv)
    if args.max_runs is not None and args.max_runs < 1:
        raise UserError(f"--max-runs {args.max_runs}: must be >= 1")
    if args.budget is not None and not args.budget > 0:
        raise UserError(f"--budget {args.budget}: must be > 0 seconds")
    if args.deadline is not None and not args.deadline > 0:
        raise UserError(f"--deadline {args.deadline}: must be > 0 seconds")
    shard = None
    if args.shard is not None:
        try:
            k, n = (int(v) for v in args.shard.split("/"))
        except ValueError:
            raise UserError(f"--shard {args.shard}: must be k/n with integers, e.g. 0/4") from None
        if not (n >= 1 and 0 <= k < n):
            raise UserError(f"--shard {args.shard}: needs n >= 1 and 0 <= k < n")
        shard = (k, n)
    threads = study_threads(args.threads, shard)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    full = study.load_plan(args.plan, args.out)
    if args.profile:
        return _study_profile(args, full, shard)
    if args.pace_from is not None and not args.estimate:
        raise UserError("--pace-from: only with --estimate")
    if args.pace_workers != 1 and not args.estimate:
        raise UserError("--pace-workers: only with --estimate")
    if args.pace_workers < 1:
        raise UserError(f"--pace-workers={args.pace_workers}: worker processes per GPU, an "
                        "integer >= 1")
    if args.pack_except is not None and args.pack is None:
        raise UserError("--pack-except: only with --pack (it names the runs --pack leaves out)")
    before = None if args.pack_except is None else study.packed_before(args.pack_except)
    if args.pace_table is not None and args.pace_from is None:
        raise UserError("--pace-table: only with --pace-from PLAN (the plan that wrote it)")
    if args.pace_table is not None:  # read now, so a wrong file is named before any pricing
        study.exported_pace(study.load_plan(args.pace_from), args.pace_table)
    for flag in ("profile_steps", "profile_lr", "profile_batch_size", "profile_phi_rule",
                 "profile_eval_every", "profile_split", "profile_rounds", "device"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')}: only with --profile")
    if args.profile_no_check:
        raise UserError("--profile-no-check: only with --profile")
    if args.stage is not None and full.tune is None:
        raise UserError(f"--stage {args.stage}: plan {full.name} has no tune section")
    stages = ["plain"] if full.tune is None else (
        [args.stage] if args.stage else ["tune", "final"])
    if args.choices is not None and "final" not in stages:
        raise UserError("--choices: only the final stage reads it; drop --stage tune")
    choices = None if args.choices is None else study.load_choices(args.choices, full)
    if args.slice and full.tune is not None:  # a pattern that names no run is a mistake
        tune_keys = [s.key for s in study.plan_runs(study.tuning_plan(full))]
        known = tune_keys + [s.key for s in study.plan_runs(full)]
        for p in args.slice:
            if not any(fnmatch.fnmatch(k, p) for k in known):
                raise UserError(f"--slice {p!r} matches no run of plan {full.name!r}; "
                                "`linattn study --plan ... --list` shows the run keys")
    failed = 0
    stage_plans = []  # the plan of every stage reached (what --pack-partial and a restore cover)
    # --deadline counts from here over both stages; only a call that trains waits for tuning
    t_call = time.monotonic()
    trains = not (args.aggregate_only or args.list or args.estimate or args.pretrain_only
                  or args.restore_partial is not None)
    for stage in stages:
        if stage == "tune":
            plan, slices = study.tuning_plan(full), args.slice
            if args.slice:  # the patterns that select tuning runs (others name final runs)
                slices = [p for p in args.slice
                          if any(fnmatch.fnmatch(k, p) for k in tune_keys)]
                if not slices:
                    if args.stage == "tune":
                        raise UserError(f"--slice {' '.join(args.slice)}: selects no tuning "
                                        f"run of plan {full.name} (tuning keys name the "
                                        "grid point: <sweep>/<arm>+<i>/...)")
                    continue
        elif stage == "final":
            slices = args.slice
            # with --slice, only the selected arms need their tuning finished (or chosen)
            partial = bool(args.slice)
            misses, seen = 0, False
            # the arms a --slice may select: only their tuning is worth waiting for
            wanted = None if not partial else {
                (s.sweep.name, s.arm.name) for s in study.plan_runs(full)
                if any(fnmatch.fnmatch(s.key, p) for p in args.slice)}

            def wait_more(wanted=wanted) -> bool:
                """A timed worker whose tuning shard ended waits for the other workers'
                tuning (they hold their runs' locks) instead of leaving its GPU idle; with
                --choices the choice cannot change, so nothing waits."""
                nonlocal misses, seen
                if not (trains and choices is None and args.deadline is not None
                        and _left(args.deadline, t_call) > TUNING_POLL_S):
                    return False
                if _tuning_in_progress(full, wanted):
                    misses, seen = 0, True
                else:
                    misses += 1
                    young = time.monotonic() - t_call < TUNING_START_S
                    if misses > TUNING_GRACE_POLLS or not (seen or young):
                        return False
                _pause(TUNING_POLL_S)
                return True

            while True:
                try:  # the table is written once the selection is known to be valid
                    table = (choices if choices is not None
                             else study.choose(full, False, partial))
                    plan = study.final_plan(full, table, partial=partial)
                except UserError as exc:  # tuning unfinished: nothing to choose from yet
                    if args.stage == "final":
                        raise
                    if wait_more():
                        continue
                    print(f"study: the final stage waits for the tuning runs ({exc})")
                    plan = None
                    break
                keys = [s.key for s in study.plan_runs(plan)] + [
                    s.key for s, _ in study.same_runs(plan)] if partial else []
                selecting = [p for p in args.slice or []
                             if any(fnmatch.fnmatch(k, p) for k in keys)]
                if partial and not selecting:
                    msg = (f"--slice {' '.join(args.slice)}: no final run of plan {full.name} "
                           "is selected whose arm has a chosen configuration")
                    if args.stage == "final":
                        raise UserError(f"{msg}; finish those arms' tuning runs (--stage tune "
                                        "with the same --slice over the tuning keys) or pass "
                                        "--choices")
                    if wait_more():
                        continue
                    print(f"study: the final stage waits for the tuning runs ({msg})")
                    plan = None
                break
            if plan is None:
                break
            skipped = [p for p in args.slice or [] if p not in selecting] if partial else []
            for p in skipped:  # its arms are not tuned yet; the other patterns go on
                print(f"study: --slice {p} selects no final run with a chosen "
                      "configuration (tuning unfinished, absent from --choices, or a T0 "
                      "not chosen); skipped")
            slices = selecting if partial else args.slice
            if choices is None and not args.list and args.restore_partial is None:
                study.write_choices(full, table)
            print("study: chosen configurations in "
                  f"{args.choices or full.out_dir / study.CHOICES_FILE}")
        else:
            plan, slices = full, args.slice
        stage_plans.append(plan)
        if args.estimate:
            rows = study.estimate(plan, slices, None if args.pace_from is None else
                                  study.load_plan(args.pace_from), args.pace_table,
                                  device_share=args.pace_workers)
            label = "" if stage == "plain" else f" ({stage})"
            print(f"study{label}: what is left, per sweep")
            for r in rows:
                gpu = "unpriced" if r["gpu_seconds"] is None else f"{r['gpu_seconds']:,.0f} GPU-s"
                print(f"  {r['sweep']:32s} {r['runs']:5d} runs {r['run_rounds']:8,d} run-rounds "
                      f"{gpu:>16s} (priced by {r['priced_by']})")
            total = [r["gpu_seconds"] for r in rows]
            print(f"  total: {sum(r['runs'] for r in rows)} runs, "
                  f"{sum(r['run_rounds'] for r in rows):,d} run-rounds"
                  + (f", {sum(total):,.0f} GPU-s" if rows and None not in total else ""))
            continue
        if args.restore_partial is not None:
            continue
        if args.list:
            seen = set()  # a listed arm's bad option exits 2 here, as its run would
            for spec in study.plan_runs(plan):
                if (spec.sweep.name, spec.arm.name) in seen or (
                        slices and not any(fnmatch.fnmatch(spec.key, p) for p in slices)):
                    continue
                seen.add((spec.sweep.name, spec.arm.name))
                try:
                    study.run_config(spec, spec.warmup_rounds)
                except ConfigError as exc:
                    raise ConfigError(f"{spec.sweep.name}/{spec.arm.name}: {exc}") from None
            for spec in study.plan_runs(plan):
                if slices and not any(fnmatch.fnmatch(spec.key, p) for p in slices):
                    continue
                print(f"{study._status(spec.run_dir):>9}  {spec.key}")
            for spec, source in study.same_runs(plan):  # trained once, as another arm's run
                if slices and not any(fnmatch.fnmatch(spec.key, p) for p in slices):
                    continue
                print(f"{'same':>9}  {spec.key} = {source.key}")
            continue
        if (not args.aggregate_only and args.deadline is not None and not args.pretrain_only
                and _left(args.deadline, t_call) <= 0):
            print(f"study ({stage}): no time left before --deadline {args.deadline:g}")
        elif not args.aggregate_only:
            try:
                counts = study.run_study(
                    plan, slices, args.max_runs, args.budget, shard=shard,
                    pretrain_only=args.pretrain_only,
                    deadline_s=(None if args.deadline is None else
                                _left(args.deadline, t_call)),
                    pending=(args.pending_before if args.pending_before is not None
                             else args.pending),
                    stack=not args.no_stack,
                    # the tuning runs' pace prices the final stage's deadline
                    price_runs=study.tuning_runs(full) if stage == "final" else None)
            except study.DeviceLost as exc:  # its runs resume in a new process
                print(f"study: {exc}", file=sys.stderr)
                return study.EXIT_DEVICE_LOST
            print(f"study{'' if stage == 'plain' else ' (' + stage + ')'}:",
                  ", ".join(f"{k} {v}" for k, v in counts.items()))
            if args.pretrain_only:
                continue
            failed += counts.get("failed", 0)
        if not args.no_tables and stage == "tune" and any(sw.reference_sweep
                                                          for sw in full.sweeps):
            table = study.choose(full, False, partial=True)  # what has finished so far
            for folder in [full.out_dir / "tables", *([args.export] if args.export else [])]:
                paths = write_difficulty(full, folder, choices=table)
                if folder != full.out_dir / "tables":
                    paths.append(study.export_choices(full, folder, table))
                print(f"wrote {', '.join(str(p) for p in paths)}")
        if not args.no_tables and stage != "tune":
            runs = study.run_rows(plan)
            rows = study.aggregate(plan, runs)
            for folder in [plan.out_dir / "tables", *([args.export] if args.export else [])]:
                paths = study.write_tables(rows, folder, runs)
                paths += study.write_t0_choice(runs, folder, plan)  # runs with a validation split
                if stage == "final":
                    paths += study.write_comparison(
                        runs, folder, bases=study.base_arms(plan),
                        personal=tuple(sw.name for sw in full.sweeps if sw.score == "personal"))
                    # FedAvg's gap to each shift's reference, on validation and on test
                    paths += write_difficulty(full, folder, table, runs)
                    # online freeze rules against the best fixed T0 (plans that run rules)
                    paths += study.write_rule_regret(plan, runs, folder)
                    if folder != plan.out_dir / "tables":  # the choices the final runs use
                        dest = study.export_choices(full, folder, table)
                        paths.append(dest)
                        # what a decay and what freezing gain on validation, by the candidates
                        paths += study.write_schedule_gains(json.loads(dest.read_text()),
                                                            folder)
                print(f"wrote {', '.join(str(p) for p in paths)}")
    if args.restore_partial is not None:
        got = study.restore_partial(stage_plans, args.restore_partial)
        print(f"study: restored {got['restored']} unfinished runs from {args.restore_partial}, "
              f"kept {got['kept']} this machine holds"
              + (f"; {got['other']} files of no run of the selected stages left out"
                 if got["other"] else ""))
        return 0
    if args.list or args.pretrain_only or args.estimate:
        return 0
    if args.markers is not None:
        print(f"marked {study.write_markers(stage_plans, args.markers)} finished runs in "
              f"{args.markers}")
    if args.pack is not None:  # every stage reached: the tuning runs choose the final ones
        packed = study.pack_results(stage_plans, args.pack, before)
        print(f"packed {packed['runs']} runs, {packed['snapshots']} snapshots into {args.pack}"
              + (f" ({packed['skipped']} that came back before left out)" if before else ""))
    if args.pack_partial is not None:
        part = study.pack_partial(stage_plans, args.pack_partial)
        print(f"packed {part['runs']} runs of {part['families']} unfinished groups "
              f"({part['bytes'] / 2**20:.1f} MiB before compression) into {args.pack_partial}")
    if failed:
        print(f"study: {failed} run(s) failed; see the FAILED lines above", file=sys.stderr)
        return 1
    return 0


def _budget_options(ap, prefix: str, lead: str, whose: str) -> None:
    """Phi's budget options (``linattn profile``: ``--steps``, ...; ``linattn study
    --profile``: ``--profile-steps``, ...)."""
    ap.add_argument(f"{prefix}steps", type=int, default=None, metavar="N",
                    help=f"{lead}minibatch steps N of Phi's budget (default 4000; the check "
                    "trains to 2N)")
    ap.add_argument(f"{prefix}lr", type=float, default=None,
                    help=f"{lead}Phi's step size (default: {whose} train.lr with "
                    f"{prefix}optimizer run, 0.001 with adam)")
    ap.add_argument(f"{prefix}batch-size", type=int, default=None,
                    help=f"{lead}Phi's batch size (default: {whose} train.batch_size)")
    ap.add_argument(f"{prefix}schedule", default="constant",
                    help=f"{lead}Phi's step size over the budget: constant, or cosine (from "
                    "the step size to 0 over N steps; the check trains 2N steps of its own); "
                    "default constant")
    ap.add_argument(f"{prefix}optimizer", default="run",
                    help=f"{lead}Phi's optimizer: run ({whose} own optimizer settings: "
                    "train.optimizer, train.momentum, train.weight_decay) or adam "
                    "(torch.optim.Adam, betas 0.9/0.999, eps 1e-8, the run's weight decay); "
                    "both clip as the run does (train.clip_grad_norm); default run")
    ap.add_argument(f"{prefix}precision", default="fp32",
                    help=f"{lead}the training's arithmetic on a float32 run: fp32, tf32 (TF32 "
                    "matmuls on CUDA) or bf16 (gradients under bf16 autocast, float32 "
                    "parameters); the validation loss is read in float32; default fp32")
    ap.add_argument(f"{prefix}phi-rule", default=None, metavar="RULE",
                    help=f"{lead}how Phi is read: min (the minimum of the validation loss over "
                    f"the budget, evaluated every {prefix}eval-every steps: early stopping on "
                    "the validation split) or last (the validation loss after the last step; "
                    "the rule of every record without a phi_rule field); default min")
    ap.add_argument(f"{prefix}no-check", action="store_true",
                    help=f"{lead}no convergence check: train N steps, not 2N (half the cost "
                    "at a constant step), and report Phi at N without a verdict; for a budget "
                    "whose convergence is shown elsewhere (its cache files carry _nocheck; "
                    "the study's tables read a checked record of the same budget where one "
                    "exists)")
    ap.add_argument(f"{prefix}eval-every", type=int, default=None, metavar="E",
                    help=f"{lead}the min rule's cadence: the validation loss is read every E "
                    "steps and after the last (default 250, or N when the budget is shorter; "
                    "1 <= E <= N; part of the profile cache's key)")


def _budget(args, prefix: str, seed: int | None = None):
    """The :class:`real_data.profile.Budget` of :func:`_budget_options`' options."""
    from real_data.profile import DEFAULT_STEPS, Budget

    steps = getattr(args, f"{prefix}steps")
    rule = getattr(args, f"{prefix}phi_rule")
    return Budget(DEFAULT_STEPS if steps is None else steps, getattr(args, f"{prefix}lr"),
                  getattr(args, f"{prefix}batch_size"), seed,
                  schedule=getattr(args, f"{prefix}schedule"),
                  optimizer=getattr(args, f"{prefix}optimizer"),
                  phi_rule=COMMAND_PHI_RULE if rule is None else rule,
                  check=not getattr(args, f"{prefix}no_check"),
                  eval_every=getattr(args, f"{prefix}eval_every"),
                  precision=getattr(args, f"{prefix}precision"))


COMMAND_PHI_RULE = "min"  # the commands' rule when --phi-rule is not given


def _profile(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="linattn profile",
        description="The kernel profile Phi(M) of a run, by its definition: Q/K frozen at the "
        "kernel M of a snapshot, every other parameter trained from the run's initial "
        "parameters on the pooled training data (all clients' training samples; the run's "
        "validation split held out) for --steps minibatch steps "
        "(the run's optimizer, train.lr and train.batch_size unless given; --optimizer adam: "
        "Adam at --lr, default 0.001); Phi = the minimum of the validation loss over the "
        "budget, read every --eval-every steps (--phi-rule min, the default), or the "
        "validation loss after the last step (--phi-rule last). Each kernel is "
        "also trained to twice the budget and the relative change of Phi is reported "
        "(converged: below 1 percent). The run must hold out a validation split "
        "(partition.validation_fraction).")
    ap.add_argument("--run", type=Path, required=True, metavar="RUN_DIR",
                    help="run directory whose config, partition and initial parameters define "
                    "Phi (config.yaml; partition.npz, rebuilt from the config when absent)")
    ap.add_argument("--rounds", type=_ints, default=[],
                    help="comma list of rounds t: Phi at RUN_DIR/checkpoints/round_<t>.pt (a T0 "
                    "family's head or a reference arm keeps one at every T0 of its sweep)")
    ap.add_argument("--kernel", type=Path, action="append", default=[], metavar="FILE",
                    help="also Phi at this checkpoint's Q/K (e.g. a reference run's snapshot), "
                    "under RUN_DIR's config; repeatable")
    _budget_options(ap, "--", "", "the run's")
    ap.add_argument("--seed", type=int, default=None,
                    help="minibatch order and dropout seed (default: the run's training seed)")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda, cuda:1, ... (default: the run's train.device)")
    ap.add_argument("--stack", type=int, default=32,
                    help="kernels trained side by side, one gradient step for all (default 32; the "
                    "results do not depend on it beyond round-off)")
    ap.add_argument("--json", type=Path, metavar="OUT",
                    help="write the results (one object per kernel) to this JSON file; while "
                    "a stack trains, its progress is saved beside it every 60 s "
                    "(partial_<digest>.pt, removed at the end), so a killed call given the same "
                    "arguments resumes where it was")
    args = ap.parse_args(argv)
    from linattn.errors import UserError
    from linattn.fileio import atomic_write_text
    from real_data.profile import run_setup

    budget = _budget(args, "", args.seed)
    if not args.rounds and not args.kernel:
        raise UserError("--rounds or --kernel: give at least one kernel to profile")
    if any(r < 0 for r in args.rounds):
        raise UserError(f"--rounds {args.rounds}: rounds must be >= 0")
    if not (args.run / "config.yaml").is_file():
        raise UserError(f"--run {args.run}: not a run directory (no config.yaml)")
    kernels = [(f"round {r}", args.run / "checkpoints" / f"round_{r}.pt") for r in args.rounds]
    kernels += [(str(k), k) for k in args.kernel]
    for _, path in kernels:  # every file first: a missing one writes nothing
        if not path.is_file():
            raise UserError(f"{path}: no such snapshot (--rounds / --kernel); the run keeps "
                            "checkpoints/round_<t>.pt only at its snapshot rounds")
    if args.json is not None and args.json.is_dir():
        raise UserError(f"--json {args.json}: is a folder; give a file name")
    if args.stack < 1:
        raise UserError(f"--stack {args.stack}: must be >= 1")
    setup = run_setup(args.run, args.device)
    results = setup.phi_many([(str(path), path) for _, path in kernels], budget, args.stack,
                             partial_dir=None if args.json is None else args.json.parent)
    for (label, _), r in zip(kernels, results, strict=True):
        check = (", no check" if r.get("check") is False else
                 "" if r["relative_change"] is None else
                 f", 2N: {r['phi_doubled']:.4f} (change {100 * r['relative_change']:.2f}%"
                 f"{'' if r['converged'] else ', NOT converged'})")
        where = (f"after {r['steps']} steps" if r["phi_rule"] == "last" else
                 f"min over {r['steps']} steps (every {r['eval_every']}) at step "
                 f"{r['phi_step']}; last {r['val_loss_last']:.4f}")
        print(f"{label}: Phi {r['phi']:.4f} (val acc {r['val_acc']:.4f}) {where}{check}, "
              f"{r['seconds']:.1f} s")
    if args.json is not None:
        import json

        atomic_write_text(args.json, json.dumps({"run": str(args.run), "kernels": results},
                                                indent=1))
        print(f"wrote {args.json}")
    return 0


def _study_profile(args, full, shard) -> int:
    """``linattn study --plan P --profile``: Phi at every snapshot, then the tables."""
    from linattn.errors import UserError
    from real_data import study

    budget = _budget(args, "profile_")
    plan = full
    if full.tune is not None:
        choices = None if args.choices is None else study.load_choices(args.choices, full)
        plan = study.final_plan(full, choices)
    if not study.profile_cells(plan):
        raise UserError(f"--profile: plan {full.name} has no sweep with both a T0 arm "
                        "(warmup_rounds) and a reference arm (reference: true)")
    records = study.profile_plan(plan, budget, device=args.device, shard=shard,
                                 deadline_s=args.deadline, compute=not args.aggregate_only,
                                 pattern=args.slice, split=args.profile_split or "cells",
                                 rounds=args.profile_rounds)
    if args.no_tables:
        return 0
    rows = study.bias_drift(records)
    choice = study.chosen_t0(study.run_rows(plan))
    for folder in [plan.out_dir / "tables", *([args.export] if args.export else [])]:
        paths = study.write_kernel_profile(rows, folder, budget, choice)
        paths += study.write_t0_choice(study.run_rows(plan), folder, plan)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _data(argv: list[str]) -> int:
    from real_data import data_cli

    return int(data_cli.main(argv) or 0)


COMMANDS = {"run": _run, "sweep": _sweep, "study": _study, "data": _data,
            "pretrain": _pretrain, "profile": _profile}


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``argv[0]`` is the subcommand (``run``, ``sweep``, ...)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        from linattn.errors import UserError

        raise UserError(f"unknown command {argv[:1]}; valid: {', '.join(COMMANDS)}")
    if argv[0] == "data":
        return _data(argv)
    return COMMANDS[argv[0]](argv[1:])
