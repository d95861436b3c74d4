"""hpcrun: render, submit and requeue multi-node PyTorch training on SLURM, and compare the runs."""

__version__ = "0.1.0"
