"""Synthetic federated simulator of two-stage FedAvg (FedFrozen) on the THEORY.md model.

Public API
----------
Setting, simulate, SimResult          (simulations.engine)  vectorized finite-sample simulator
compute_metrics, population           (simulations.metrics) exact population metrics, dynamics
run_single                            (simulations.loop)    plain-loop oracle
run_validation, Grid                  (simulations.validate) checks P1-P6
load_config, SimConfig, ConfigError   (simulations.config)  YAML configs
"""

from simulations.config import ConfigError, SimConfig, load_config
from simulations.engine import Setting, SimResult, simulate
from simulations.metrics import compute_metrics, population

__all__ = ["ConfigError", "SimConfig", "load_config", "Setting", "SimResult", "simulate",
           "compute_metrics", "population"]
