"""A plain Lightning script: nothing of hpcrun in it, and it runs under hpcrun unchanged
(jobs/lightning.yaml). Under SLURM, Lightning reads the allocation from SLURM's variables;
hpcrun's callback (loaded by Lightning through its entry point, hpcrun.lightning) saves
Lightning's HPC checkpoint when the job must stop, and Lightning resumes from it when the
requeued job starts again.
"""

import argparse
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--nodes", type=int, default=1)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--strategy", default="ddp")  # Lightning's fsdp and deepspeed_stage_* need GPUs
parser.add_argument("--accumulate", type=int, default=1)  # batches per optimizer step
parser.add_argument("--step-delay-s", type=float, default=0.0)  # lets tests signal a short run mid-way
args = parser.parse_args()


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        time.sleep(args.step_delay_s)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


L.seed_everything(0)
generator = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=generator)
data = TensorDataset(x, x.sum(dim=1, keepdim=True))
trainer = L.Trainer(
    accelerator="auto", devices=args.devices, num_nodes=args.nodes, strategy=args.strategy,
    max_steps=args.steps, accumulate_grad_batches=args.accumulate, enable_progress_bar=False,
    enable_model_summary=False, logger=False,
)
trainer.fit(Regression(), DataLoader(data, batch_size=8))
if trainer.is_global_zero:
    print(f"lightning job: {trainer.global_step} steps over {trainer.world_size} ranks done", flush=True)
