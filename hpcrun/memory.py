"""The memory planner: which strategies fit a partition, before anything is submitted.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3): with
mixed-precision Adam each parameter costs 2 bytes (fp16/bf16 weights) + 2 (gradients) + K=12
(fp32 master weights, momentum, variance); fp32 training costs 4 + 4 + 8. ZeRO stage 1 divides
the optimizer states by the data-parallel degree N, stage 2 also the gradients, stage 3 also the
weights; FSDP's FULL_SHARD is stage 3, SHARD_GRAD_OP stage 2, HYBRID_SHARD stage 3 within a node.
Activations are what autograd keeps for the built-in GPT (hpcrun.runtime.model), counted per layer
and token the way Korthikanti et al. 2022 count theirs, but for this model's kernels: its
`scaled_dot_product_attention` runs flash or memory-efficient kernels (CUDA, and flash on CPU),
which keep no s x s score matrix, so their 5·a·s term is gone; tests/test_activations.py measures
it. On top: autocast's 16-bit copy of DDP's fp32 weights, and the loss's buffers; FSDP's gradients,
freed by zero_grad, never coexist with a forward's activations.
"""

from __future__ import annotations

import dataclasses

from hpcrun.plan import RunSpec
from hpcrun.sizes import LOSS_CHUNK_TOKENS
from hpcrun.strategies import Option, planner_options

GB = 1e9  # the paper's unit


def options() -> list[Option]:
    """What the planner weighs, in order of preference: every registered strategy's layouts."""
    return planner_options()


def model_state_bytes(params: float, n: int, option: Option, mixed: bool, per_node: int = 1) -> tuple[float, float]:
    """(bytes per GPU, bytes moved off the GPU per rank) of weights, gradients and optimizer."""
    w, g, k = (2, 2, 12) if mixed else (4, 4, 8)
    # HYBRID_SHARD shards everything within a node and replicates across nodes
    group = min(n, per_node) if option.shard_params == "node" else n
    weights = w * params / (1 if option.shard_params == "none" else group)
    grads = g * params / (group if option.shard_grads else 1)
    optim = k * params / (group if option.shard_optim else 1)
    if option.offload != "none":  # ZeRO-Infinity / Offload: only working buffers stay on the GPU
        return 0.0, weights + grads + optim
    return weights + grads + optim, 0.0


def grad_bytes(params: float, n: int, option: Option, mixed: bool, per_node: int = 1) -> float:
    """The gradients' share of model_state_bytes on each GPU."""
    group = min(n, per_node) if option.shard_params == "node" else n
    return (2 if mixed else 4) * params / (group if option.shard_grads else 1)


def staging_bytes(params: float, n: int, option: Option, per_node: int) -> float:
    """Host memory per node an asynchronous DCP save (DDP, FSDP) copies each rank's state into:
    fp32 weights and Adam's two moments, 12 bytes per parameter, as sharded as the weights."""
    if not option.stages_checkpoints:
        return 0.0  # saved synchronously (DeepSpeed)
    group = n if option.shard_params == "all" else min(n, per_node) if option.shard_params == "node" else 1
    return 12 * params / group * per_node


def snapshot_bytes(params: float, n: int, option: Option, per_node: int, nodes: int) -> float:
    """Host memory per node in-memory snapshots take (`checkpoint.memory_interval`; DDP, FSDP):
    the node's ranks' state (as staged for a save) twice, the newest complete step and the one
    being written, twice again for the replicas of another node's ranks, plus the staging buffers.
    DDP's ranks hold the same state: one rank per node keeps it."""
    if not option.stages_checkpoints:
        return 0.0  # DeepSpeed keeps no snapshots
    copies = 2 * (2 if nodes > 1 else 1) + 1
    holders = 1 if option.one_snapshot_per_node else per_node
    return copies * staging_bytes(params, n, option, holders)


def layer_activation_bytes(hidden: int, heads: int, seq_len: int, mixed: bool, scores: bool = False) -> float:
    """Bytes autograd keeps per token for one block. Under autocast (mixed) the residual stream and
    both LayerNorm inputs stay fp32 (4h each, plus 8 for mean and rstd), the 16-bit copies feeding
    qkv and fc 2h each, q, k, v 6h, the attention output 2h (the proj input is a view of it) and its
    fp32 log-sum-exp 4 per head, the GELU input and output 8h each: 36h + 4a + 16. In fp32 every
    16-bit tensor doubles: 64h + 4a + 16. `scores`: SDPA's math fallback keeps the fp32 softmax
    (4·a·s) instead of the log-sum-exp, and its own copies of q, k, v: as measured on CPU, 6h more
    under autocast (it upcasts them to fp32), 4h less in fp32."""
    per = (36 if mixed else 64) * hidden + 4 * heads + 16
    if scores:
        per += 4 * heads * seq_len - 4 * heads + (6 if mixed else -4) * hidden
    return float(per)


def loss_bytes(hidden: int, vocab: int, mixed: bool) -> float:
    """Bytes autograd keeps per token for the final LayerNorm, the tied output projection and the
    loss: the norm's fp32 input (4h + 8), the projection's input (2h, or 4h in fp32), the int64
    target and the fp32 log-softmax cross-entropy keeps (4V)."""
    return float(4 * hidden + 8 + (2 if mixed else 4) * hidden + 8 + 4 * vocab)


def saved_activation_bytes(spec: RunSpec, micro_batch: int | None = None, scores: bool = False) -> float:
    """What autograd keeps for one micro-batch (the recipe's, or `micro_batch`) of the built-in GPT
    at the end of its forward; `scores` for SDPA's math fallback (see layer_activation_bytes)."""
    t = spec.recipe.training
    size = spec.size
    assert size is not None, "the planner knows the built-in model only"
    mixed = spec.recipe.precision != "fp32"
    block = layer_activation_bytes(size.hidden, size.heads, t.seq_len, mixed, scores)
    # with activation checkpointing each block keeps its fp32 input, and one block's activations live again
    layers = size.layers * 4 * size.hidden + block if t.activation_checkpointing else size.layers * block
    return (micro_batch or t.micro_batch) * t.seq_len * (layers + loss_bytes(size.hidden, size.vocab, mixed))


def activation_bytes(spec: RunSpec, micro_batch: int | None = None, scores: bool = False) -> float:
    """Activations at the peak, the start of backward: what autograd keeps, plus the two fp32
    vocabulary-wide gradients (8V per token) the loss's backward holds at once, for the whole
    micro-batch on CPU and for one chunk of LOSS_CHUNK_TOKENS on a GPU (chunked_cross_entropy)."""
    assert spec.size is not None, "the planner knows the built-in model only"
    tokens = (micro_batch or spec.recipe.training.micro_batch) * spec.recipe.training.seq_len
    in_backward = min(tokens, LOSS_CHUNK_TOKENS) if spec.partition_spec.gpu else tokens
    return saved_activation_bytes(spec, micro_batch, scores) + in_backward * 8 * spec.size.vocab


@dataclasses.dataclass(frozen=True)
class Estimate:
    option: Option
    gpu_gb: float
    cpu_gb_per_node: float
    nvme_gb_per_node: float
    fits: bool
    why: str
    deepspeed_gpu_gb: float | None = None  # DeepSpeed's own estimate of model states, where it applies
    snapshot_gb_per_node: float = 0.0  # in-memory snapshots' share of cpu_gb_per_node (node-local tmpfs)


def estimate(spec: RunSpec, weighed: list[Option] | None = None, micro_batch: int | None = None) -> list[Estimate]:
    """Every option (or those `weighed`) for `spec`'s model on its partition (at the recipe's
    micro-batch, or `micro_batch`), with whether it fits and why not."""
    part = spec.partition_spec
    t = spec.recipe.training
    size = spec.size
    assert size is not None, "the planner knows the built-in model only"
    params = size.parameters(t.seq_len)
    n, per_node = spec.world_size, spec.ranks_per_node
    mixed = spec.recipe.precision != "fp32"
    activations = activation_bytes(spec, micro_batch)
    gpu_cap = part.gpu.memory_gb * GB if part.gpu else part.memory_gb * GB / per_node
    host_cap = part.memory_gb * GB
    nvme = spec.nvme
    out = []
    largest = max(size.vocab * size.hidden, 4 * size.hidden * size.hidden)
    # the `heavy` stand-in's frozen fp32 state: held as weights are, staged and snapshotted as 1/12 of
    # a trained parameter's 12 bytes
    frozen = float(size.ballast_mb * 2**20)
    for option in options() if weighed is None else weighed:
        on_gpu, moved = model_state_bytes(params, n, option, mixed, per_node)
        on_gpu += frozen / (1 if option.shard_params == "none" else min(n, per_node) if option.shard_params == "node"
                            else n)
        ds = option.library_estimate(params, largest, per_node, spec.nodes) if option.library_estimate else None
        # fit against the larger of the two accountings: DeepSpeed's counts what it allocates
        # autocast over fp32 weights keeps a 16-bit copy of every weight for the step
        casts = 2 * params if mixed and option.casts_weights else 0.0
        states = max(on_gpu, ds[1] if ds else 0.0) + casts
        # gradients freed by zero_grad (FSDP) come back as activations go: the peak holds one or the other
        grads = grad_bytes(params, n, option, mixed, per_node) if option.frees_grads and on_gpu else 0.0
        gpu = states - grads + max(activations, grads)
        cpu = max(
            moved * per_node if option.offload == "cpu" else 0.0, ds[0] if ds and option.offload == "cpu" else 0.0
        )
        asynchronous = spec.recipe.checkpoint.asynchronous
        staged = staging_bytes(params + frozen / 12, n, option, per_node) if asynchronous else 0.0
        cpu += staged
        snapshots = (
            snapshot_bytes(params + frozen / 12, n, option, per_node, spec.nodes) if spec.takes_snapshots else 0.0
        )
        cpu += snapshots
        disk = moved * per_node if option.offload == "nvme" else 0.0
        problems = []
        why = (
            f" ({staged / GB:.0f} GB to stage asynchronous checkpoints; checkpoint.asynchronous: false saves that)"
            if staged
            else ""
        ) + (
            f" ({snapshots / GB:.0f} GB of in-memory snapshots; checkpoint.memory_interval: 0 saves that)"
            if snapshots
            else ""
        )
        if gpu > gpu_cap:
            problems.append(f"needs {gpu / GB:.1f} GB per GPU, has {gpu_cap / GB:.0f}")
        elif not part.gpu and gpu * per_node + cpu > host_cap:  # CPU ranks, offload and staging share one memory
            problems.append(
                f"needs {(gpu * per_node + cpu) / GB:.0f} GB memory per node "
                f"({per_node} ranks x {gpu / GB:.1f} + {cpu / GB:.0f}), has {host_cap / GB:.0f}{why}"
            )
        if part.gpu and cpu > host_cap:
            problems.append(f"needs {cpu / GB:.0f} GB host memory per node, has {host_cap / GB:.0f}{why}")
        if option.offload == "nvme" and (nvme is None or disk > nvme.size_gb * GB):
            problems.append(
                "no storage.nvme in the site"
                if nvme is None
                else f"needs {disk / GB:.0f} GB NVMe per node, has {nvme.size_gb:.0f}"
            )
        out.append(
            Estimate(
                option,
                gpu / GB,
                cpu / GB,
                disk / GB,
                not problems,
                "; ".join(problems) or "fits",
                ds[1] / GB if ds else None,
                snapshots / GB,
            )
        )
    return out


def recommend(estimates: list[Estimate]) -> tuple[Estimate | None, str]:
    """The first option that fits: options are ordered by how much they communicate and move."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None, "nothing fits: use more nodes, a smaller micro batch, or activation checkpointing"
    best = fitting[0]
    later = [e.option.name for e in estimates if estimates.index(e) < estimates.index(best)]
    why = f"{best.option.name} fits ({best.gpu_gb:.1f} GB per GPU)"
    if later:
        why += f"; {', '.join(later)} would not ({next(e.why for e in estimates if e.option.name == later[-1])})"
    return best, why + "; the fitting option with the least communication"


def largest_micro_batch(spec: RunSpec, option: Option, limit: int = 4096) -> int:
    """The largest micro-batch at which `option` fits `spec`'s partition (0: not even one sample)."""

    def fits(mb: int) -> bool:
        return estimate(spec, [option], mb)[0].fits

    low, high = 0, 1  # fits(low) (0 trivially), and the search doubles `high` until it does not
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def misfit(spec: RunSpec) -> str | None:
    """Why the recipe's own strategy will not fit its partition, or None (built-in model only)."""
    if spec.size is None:
        return None
    wanted = spec.strategy.memory_option()
    (verdict,) = estimate(spec, [wanted])
    return None if verdict.fits else f"planner: {wanted.name} {verdict.why}"
