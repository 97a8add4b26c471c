"""The real-data validation study: a plan of sweeps, run resumably in slices, then aggregated.

A plan (YAML, ``real_data/studies/<name>.yaml``)::

    name: main
    out_dir: runs/study-main          # every run directory lives under here
    seeds: [0, 1, 2]
    sweeps:
      - name: fmnist_softmax
        config: fmnist_vit           # a shipped config name or a YAML path
        overrides: [train.rounds=200, model.attention=softmax]
        alphas: [0.1, 0.3, 1.0]      # partition.alpha values (omit for natural splits)
        arms:
          - {name: fedavg, overrides: [algorithm.name=fedavg]}
          - {name: fedfrozen_v, overrides: [algorithm.name=fedfrozen, algorithm.train=v],
             warmup_rounds: [0, 10, 20, 40, 80, 120, 200]}
          - {name: reference, overrides: [partition.scheme=iid, partition.num_clients=1],
             reference: true}

Each run has a fixed directory ``out_dir/<sweep>/<arm>[-T0=<t>]/alpha=<a>/seed=<s>``, so the
study knows what exists: a completed run is skipped, an interrupted one resumed from its last
checkpoint, a missing one started. An arm with ``warmup_rounds`` trains the warm-up once (the
largest T0, keeping a snapshot at every T0) and branches every other T0 from its snapshot. A
``reference`` arm (a drift-free run, e.g. one client holding the pooled data) keeps snapshots at
every T0 of its sweep, so the Q/K kernel deviation of FedFrozen's warm-up from it can be
measured. ``--slice`` selects runs by a glob over ``<sweep>/<arm>/alpha=<a>/seed=<s>`` so a large
plan splits into GPU calls of under 10 minutes each; ``--budget`` stops starting new runs after
that many seconds; ``--shard k/n`` takes the k-th of n cost-balanced parts of the selection, so n
workers (one or more per GPU) run one plan side by side without touching the same run.

A plan may name central pretraining jobs (FedSQ's transfer initialization) under ``pretrain``;
each writes ``<out_dir>/pretrained/<name>.pt`` before any selected run that needs it starts, and
``{out_dir}`` in an override is replaced by the plan's output folder::

    pretrain:
      - {name: mnist_softmax, config: fmnist_vit_fedsq, source: mnist, epochs: 3,
         overrides: [model.attention=softmax]}
    # an arm then uses  algorithm.pretrained={out_dir}/pretrained/mnist_softmax.pt

Aggregation reads every run's ``metrics.csv`` and ``summary.json`` and writes, per sweep, arm,
T0 and alpha: mean +- std over seeds (with the number of seeds) of final and best accuracy,
rounds-to-best, the accuracy variance over the last rounds, personalized accuracy, the
gradient-norm jump after aggregation, Q/K kernel deviation from the reference, bytes sent and
training FLOPs.

A plan with a ``tune`` section and grids runs in two stages: every grid point on a tuning seed
scored on a validation split, then the chosen configurations over every seed, compared by
paired intervals and an equivalence test (:mod:`~real_data.study.tuning`). An arm with a
single candidate (one grid point, at most one T0) has nothing to choose and takes no tuning
run, except FedAvg where a reference sweep reads its validation score. A final arm whose
chosen configuration trains exactly as an earlier arm's (FedFrozen choosing T0 = T, never
freezing, at FedAvg's or FedProx's configuration: the same run to the bit) trains nothing: its
runs are that arm's (``--list`` shows them as ``same``), and the tables read them under its
own name, so the comparison says ``identical``.

``linattn study --plan P --profile`` evaluates the kernel profile Phi (:mod:`real_data.profile`)
at every T0 snapshot of a T0 arm and of the reference arms and writes kernel bias and drift by
their definitions (:mod:`~real_data.study.profile_tables`). Where the runs hold out a validation
split, the tables also give the validation-selected T0 of each T0 arm with a bootstrap interval
over seeds (``t0_choice.{csv,md}``).

A sweep with ``score: personal`` (default ``global``) compares every client's own model: its
tuning reads each client's own validation samples under the run's model for that client (a
personalized method's, or the global model after ``eval.finetune``'s local round) at the last
round, and its score is the same on the clients' test splits, so FedTP meets FedAvg and
FedFrozen with local fine-tuning on its own metric.

A sweep with ``reference_sweep: <name>`` (a shifted data set beside the same data unshifted)
gets its difficulty measured: FedAvg's gap to the reference on validation (after tuning) and
on test (after the final runs), and concept shifts paired with the covariate shift of the
nearest gap, in ``difficulty.{csv,md}`` (:mod:`~real_data.study.difficulty`).

The parts: :mod:`~real_data.study.plan` (the plan file, its runs and their configs),
:mod:`~real_data.study.runner` (running, resuming, sharding),
:mod:`~real_data.study.tuning` (the tuning stage and the choice),
:mod:`~real_data.study.difficulty` (a shift's difficulty),
:mod:`~real_data.study.carry` (unfinished groups moved to another machine) and
:mod:`~real_data.study.tables` (aggregation, tables, comparisons, archives). This package
gathers their public names, so ``from real_data import study`` is all a caller needs.
"""


from __future__ import annotations

from real_data.study.carry import pack_partial, restore_partial
from real_data.study.plan import (
    Arm,
    Plan,
    PretrainJob,
    RunSpec,
    Sweep,
    Tune,
    load_plan,
    plan_runs,
    replace_out,
    run_config,
    run_key,
    run_overrides,
    same_runs,
    stage_runs,
    training_identity,
)
from real_data.study.profile_tables import (
    BEST_RULE,
    bias_drift,
    profile_cells,
    profile_plan,
    trends,
    write_kernel_profile,
)
from real_data.study.rule_report import rule_regret, write_rule_regret
from real_data.study.runner import (
    EXIT_DEVICE_LOST,
    FINAL,
    DeviceLost,
    batch_cost,
    device_unusable,
    ensure_pretrained,
    estimate,
    exported_pace,
    group_cost,
    measured_pace,
    run_status,
    run_study,
    shard_groups,
)
from real_data.study.tables import (
    LAST_ROUNDS,
    SCORE_LAST,
    aggregate,
    base_arms,
    chosen_t0,
    compare,
    compare_with_bases,
    kernel_deviation,
    pack_results,
    packed_before,
    paired_differences,
    run_rows,
    write_comparison,
    write_markers,
    write_t0_choice,
    write_tables,
)
from real_data.study.tuning import (
    CHOICES_FILE,
    choose,
    export_choices,
    final_plan,
    grid_points,
    load_choices,
    schedule_gains,
    tuning_plan,
    tuning_runs,
    write_choices,
    write_schedule_gains,
)

# short names the command line (real_data/cli.py), scripts/cpu_references.py and the tests use
_key = run_key
_overrides = run_overrides
_status = run_status
_group_cost = group_cost

__all__ = [
    "rule_regret",
    "write_rule_regret",
    "BEST_RULE",
    "CHOICES_FILE",
    "bias_drift",
    "chosen_t0",
    "profile_cells",
    "profile_plan",
    "trends",
    "write_kernel_profile",
    "write_t0_choice",
    "FINAL",
    "EXIT_DEVICE_LOST",
    "DeviceLost",
    "device_unusable",
    "LAST_ROUNDS",
    "SCORE_LAST",
    "Tune",
    "choose",
    "base_arms",
    "compare",
    "compare_with_bases",
    "export_choices",
    "schedule_gains",
    "write_schedule_gains",
    "final_plan",
    "load_choices",
    "grid_points",
    "tuning_plan",
    "tuning_runs",
    "write_choices",
    "write_comparison",
    "Arm",
    "Plan",
    "PretrainJob",
    "RunSpec",
    "Sweep",
    "aggregate",
    "ensure_pretrained",
    "batch_cost",
    "group_cost",
    "kernel_deviation",
    "load_plan",
    "measured_pace",
    "estimate",
    "exported_pace",
    "pack_partial",
    "pack_results",
    "packed_before",
    "paired_differences",
    "plan_runs",
    "stage_runs",
    "same_runs",
    "training_identity",
    "replace_out",
    "run_config",
    "run_key",
    "run_overrides",
    "restore_partial",
    "run_rows",
    "run_status",
    "run_study",
    "shard_groups",
    "write_markers",
    "write_tables",
]
