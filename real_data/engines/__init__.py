"""Engines train one round's sampled clients: ``engine(job: LocalJob) -> ClientResults``.

``vectorized`` stacks the clients (batched GEMMs and CUDA graphs for the ViT and the character
Transformer, ``torch.func.vmap`` otherwise); ``vectorized_compiled`` adds ``torch.compile``;
``sequential`` is the plain reference loop. All share :func:`make_batches`, so they see the
same minibatches.
"""

from __future__ import annotations

from linattn.errors import ConfigError
from real_data.engines.base import (
    Batches,
    BatchPlanner,
    ClientResults,
    Engine,
    LocalJob,
    OptimizerSpec,
    client_rng,
    make_batches,
    task_loss,
)
from real_data.engines.sequential import train_sequential
from real_data.engines.vectorized import train_vectorized, train_vectorized_compiled

ENGINES: dict[str, Engine] = {"vectorized": train_vectorized,
                              "vectorized_compiled": train_vectorized_compiled,
                              "sequential": train_sequential}

__all__ = [
    "ENGINES",
    "BatchPlanner",
    "Batches",
    "ClientResults",
    "Engine",
    "LocalJob",
    "OptimizerSpec",
    "client_rng",
    "get_engine",
    "make_batches",
    "task_loss",
    "train_sequential",
    "train_vectorized",
    "train_vectorized_compiled",
]


def get_engine(name: str) -> Engine:
    """Look up an engine; unknown names list the valid ones."""
    if name not in ENGINES:
        raise ConfigError(f"train.engine: unknown engine {name!r}; valid: {', '.join(ENGINES)}")
    return ENGINES[name]
