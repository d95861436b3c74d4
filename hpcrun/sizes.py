"""Named sizes of the built-in GPT benchmark. Pure data, so the planner and validation can
use it on a login node without importing torch."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPTSize:
    layers: int
    hidden: int
    heads: int
    vocab: int = 50304  # GPT-2's vocabulary padded to a multiple of 128 for tensor cores
    ballast_mb: int = 0
    """Frozen fp32 state (MiB per model) that every checkpoint and snapshot carries but no step
    computes with: a CPU stand-in for a GPU's ratio of state bytes to step time (`heavy`)."""

    @property
    def ballast_elements(self) -> int:
        return self.ballast_mb * 2**20 // 4

    def parameters(self, seq_len: int) -> int:
        """Parameter count with tied embeddings: 12·L·H² for the blocks (+ biases and norms),
        token and position embeddings."""
        per_block = 12 * self.hidden**2 + 13 * self.hidden
        return self.layers * per_block + self.vocab * self.hidden + seq_len * self.hidden + 2 * self.hidden

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the weights plus 12·L·H·T for attention scores
        (PaLM appendix B; Q·T there is the hidden size times the sequence length)."""
        return 6 * self.parameters(seq_len) + 12 * self.layers * self.hidden * seq_len


# rows of each cross-entropy on a GPU: its vocabulary-wide fp32 buffers hold this many tokens, not the batch
LOSS_CHUNK_TOKENS = 1024

SIZES: dict[str, GPTSize] = {
    "tiny": GPTSize(layers=2, hidden=64, heads=4, vocab=512),
    "small": GPTSize(layers=4, hidden=256, heads=4, vocab=8192),
    # `small`'s steps with half a GiB more state per model replica: a snapshot's copy takes several
    # steps, as a 15 GB state's does at a GPU's 0.13 s step (benchmarks/recovery_cost.py)
    "heavy": GPTSize(layers=4, hidden=256, heads=4, vocab=8192, ballast_mb=512),
    "125m": GPTSize(layers=12, hidden=768, heads=12),
    "350m": GPTSize(layers=24, hidden=1024, heads=16),
    "760m": GPTSize(layers=24, hidden=1536, heads=16),
    "1.3b": GPTSize(layers=24, hidden=2048, heads=32),
    "2.7b": GPTSize(layers=32, hidden=2560, heads=32),
    "6.7b": GPTSize(layers=32, hidden=4096, heads=32),
    "13b": GPTSize(layers=40, hidden=5120, heads=40),
}
