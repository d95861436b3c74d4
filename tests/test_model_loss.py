"""The built-in model's GPU loss (chunked cross-entropy) and optimizer choice, checked on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpcrun.runtime.jobs import adamw
from hpcrun.runtime.model import chunked_cross_entropy
from hpcrun.sizes import LOSS_CHUNK_TOKENS


def test_chunked_cross_entropy_is_the_mean_over_the_batch() -> None:
    """Two full chunks and a partial one: the same loss and gradients as one cross-entropy."""
    g = torch.Generator().manual_seed(0)
    tokens = 2 * LOSS_CHUNK_TOKENS + 100
    hidden = torch.randn(tokens, 32, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(257, 32, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 257, (tokens,), generator=g)
    chunked = chunked_cross_entropy(hidden, weight, targets)
    whole = F.cross_entropy((hidden @ weight.T).float(), targets)
    assert torch.allclose(chunked, whole, rtol=1e-6)
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    whole_grads = torch.autograd.grad(whole, (hidden, weight))
    for a, b in zip(chunked_grads, whole_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_adamw_fuses_only_on_cuda() -> None:
    """The fused kernel needs CUDA tensors; CPU keeps the default the resume tests pinned."""
    cpu = adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    assert cpu.defaults["fused"] is None and cpu.defaults["betas"] == (0.9, 0.95)
    if torch.cuda.is_available():
        assert adamw([torch.nn.Parameter(torch.zeros(3, device="cuda"))], lr=1e-3).defaults["fused"] is True


def test_compiled_blocks_compute_what_eager_ones_do() -> None:
    """`training.compile` compiles each block in place: the same state-dict names (checkpoints load
    either way) and, through the eager backend (no code generation: fast), the same numbers."""
    from hpcrun.runtime.model import GPT
    from hpcrun.sizes import SIZES

    torch.manual_seed(0)
    eager = GPT(SIZES["tiny"], 16)
    compiled = GPT(SIZES["tiny"], 16)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks(backend="eager")
    assert list(compiled.state_dict()) == list(eager.state_dict())
    tokens = torch.randint(0, SIZES["tiny"].vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(compiled(tokens, tokens), eager(tokens, tokens))
