"""Code that runs inside the allocation. The only part of hpcrun that imports torch/deepspeed."""
