"""PyTorch federated runner on real data: data, partitions, models, algorithms, engines, runs."""
