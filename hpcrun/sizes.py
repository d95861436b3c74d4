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
    "125m": GPTSize(layers=12, hidden=768, heads=12),
    "350m": GPTSize(layers=24, hidden=1024, heads=16),
    "760m": GPTSize(layers=24, hidden=1536, heads=16),
    "1.3b": GPTSize(layers=24, hidden=2048, heads=32),
    "2.7b": GPTSize(layers=32, hidden=2560, heads=32),
    "6.7b": GPTSize(layers=32, hidden=4096, heads=32),
    "13b": GPTSize(layers=40, hidden=5120, heads=40),
}
