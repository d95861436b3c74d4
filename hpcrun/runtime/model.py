"""The built-in GPT-style decoder and its synthetic, learnable token stream."""

from __future__ import annotations

import math
import typing as tp

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcrun.sizes import LOSS_CHUNK_TOKENS, GPTSize


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x MLP."""

    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.heads = size.heads
        self.ln1 = nn.LayerNorm(size.hidden)
        self.qkv = nn.Linear(size.hidden, 3 * size.hidden)
        self.proj = nn.Linear(size.hidden, size.hidden)
        self.ln2 = nn.LayerNorm(size.hidden)
        self.fc = nn.Linear(size.hidden, 4 * size.hidden)
        self.out = nn.Linear(4 * size.hidden, size.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, size: GPTSize, seq_len: int, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.size = size
        self.activation_checkpointing = activation_checkpointing
        self.tok = nn.Embedding(size.vocab, size.hidden)
        self.pos = nn.Embedding(seq_len, size.hidden)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.hidden)
        if size.ballast_mb:  # saved and restored like any weight; no gradient, no optimizer state
            self.ballast = nn.Parameter(torch.empty(size.ballast_elements), requires_grad=False)
        self.reset_parameters()

    def compile_blocks(self, **options: tp.Any) -> None:
        """torch.compile each block's forward in place (`options` go to torch.compile): the blocks are
        one code object, compiled once, and the state dict's names, so checkpoints, stay as they are."""
        for block in self.blocks:
            block.compile(**options)

    def reset_parameters(self) -> None:
        for name, module in self.named_modules():
            self.init_module(name, module)

    def init_module(self, name: str, module: nn.Module) -> None:
        """GPT-2 initialisation of one module's own parameters (residual projections scaled by
        1/sqrt(2L)); meta-device initialisation calls it module by module."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.size.layers) if name.endswith(("proj", "out")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                nn.init.zeros_(bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, GPT) and module.size.ballast_mb:
            with torch.no_grad():
                module.ballast.fill_(1.0)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=False)
                if self.activation_checkpointing and self.training
                else block(x)
            )
        if not x.is_cuda:  # one cross-entropy over the batch: the numbers CPU runs and their resume tests pinned
            logits = self.ln(x) @ self.tok.weight.T  # tied embeddings
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return chunked_cross_entropy(self.ln(x).view(-1, x.shape[-1]), self.tok.weight, targets.reshape(-1))


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` computed LOSS_CHUNK_TOKENS rows at a time: the fp32
    logits and the two fp32 gradients backward makes of them exist for one chunk at a time, not for
    the whole batch (1.6 GB less at 1.3b, micro-batch 2 x 2048); only log-softmax's output is kept."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], LOSS_CHUNK_TOKENS):
        logits = hidden[i : i + LOSS_CHUNK_TOKENS] @ weight.T
        total = total + F.cross_entropy(logits.float(), targets[i : i + LOSS_CHUNK_TOKENS], reduction="sum")
    return total / hidden.shape[0]


def synthetic_batch(
    seed: int, step: int, first_sample: int, count: int, seq_len: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples `first_sample .. first_sample+count` of `step`: a deterministic function of
    (seed, step, sample index) alone, so any world size sees the same global batch and a
    resumed run sees the same data. Each sample is an arithmetic progression mod `vocab` with
    a random start and stride: learnable, so the loss really falls."""
    rows = []
    for i in range(first_sample, first_sample + count):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + i)
        start = torch.randint(0, vocab, (1,), generator=g)
        stride = torch.randint(1, 8, (1,), generator=g)
        rows.append((start + stride * torch.arange(seq_len + 1)) % vocab)
    data = torch.stack(rows)
    return data[:, :-1], data[:, 1:]
