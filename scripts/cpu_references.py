"""The drift-free reference runs (one client, pooled data) of seeds 0 and 2, on the CPU.

The main study's Fashion-MNIST (softmax) reference arm at alpha 0.1 for these two seeds comes
from here (docs/results/real_data_study.md, "The plan, the data files and the commands"):
``python scripts/cpu_references.py``. Same plan config as the GPU study's reference arm plus
``eval.clients=false eval.every=10`` (evaluation does not touch training, and the 10k-image
test pass dominates the CPU round time); fp32 on the CPU where the GPU runs use bf16 autocast.
"""

from real_data import study
from real_data.config import load_config
from real_data.runs import start_run

plan = study.load_plan("main")
for seed in (0, 2):
    spec = next(s for s in study.plan_runs(plan)
                if s.key == f"fmnist_softmax/reference/alpha=0.1/seed={seed}")
    if study._status(spec.run_dir) == "completed":
        continue
    extra = ["eval.clients=false", "eval.every=10"]
    cfg = load_config(spec.sweep.config, study._overrides(spec, None) + extra)
    spec.run_dir.parent.mkdir(parents=True, exist_ok=True)
    print("start", spec.key, flush=True)
    start_run(cfg, out=spec.run_dir, snapshot_rounds=(0, 10, 20, 40, 80, 120, 200))
    print("done", spec.key, flush=True)
