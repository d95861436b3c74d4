"""An example of your own training code under hpcrun: a function that takes the context.

`ctx.setup(model, make_optimizer)` applies the recipe's strategy (DDP, FSDP or DeepSpeed) and
resumes from the run's last checkpoint. `ctx.steps()` yields the steps still to do, and between
steps checkpoints every `checkpoint.interval` and stops cleanly on a requeue signal. The model's
`forward(inputs, targets)` returns the loss, so `engine.micro_step` works for every strategy.
"""

import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def train(ctx) -> None:
    torch.manual_seed(ctx.args.get("seed", 0))
    engine = ctx.setup(Regressor(), lambda params: torch.optim.Adam(params, lr=ctx.args.get("lr", 0.01)))
    for step in ctx.steps():
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)  # data is a function of the step
        x = torch.randn(32, 16, generator=g)
        loss = engine.micro_step(x.to(ctx.device), x.sum(dim=1, keepdim=True).to(ctx.device), last=True)
        engine.optimizer_step()
        ctx.record_loss(loss)
    ctx.log(examples_seen=32 * ctx.world_size * ctx.recipe.training.steps)
