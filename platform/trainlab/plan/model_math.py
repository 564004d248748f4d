"""Closed-form model arithmetic: parameter counts, memory per device, FLOPs per token.

Pure functions of the config section values; no torch. Each formula names its
source so it can be checked against the paper. The memory formulas here
(`model_state_bytes`, `activation_bytes*`) are the papers' idealized programs
(ZeRO's 2+2+12 bytes per parameter, Korthikanti's activations), kept as
references; what trainlab's trainer allocates is `trainlab.plan.memory`.
"""

from __future__ import annotations

from trainlab.config.schema import ModelConfig
from trainlab.models.registry import ParamCount, arch_of

__all__ = [
    "GiB",
    "ParamCount",
    "activation_bytes",
    "activation_bytes_per_layer",
    "count_params",
    "flops_per_token",
    "model_state_bytes",
    "state_bytes_per_param",
]

GiB = 1024**3


# --------------------------------------------------------------------------- parameters


def count_params(m: ModelConfig) -> ParamCount:
    """Exact parameter count of the model trainlab builds from `m`, as its
    architecture (trainlab.models.archs) counts it.

    GPT-2 small (h=768, L=12, V=50257, T=1024, tied) gives 124,439,808;
    Llama-2-7B (h=4096, L=32, a=32, f=11008, V=32000, untied) gives 6,738,415,616.
    """
    return arch_of(m).count_params(m)


# --------------------------------------------------------------------------- model states


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter for AdamW.

    Mixed precision (bf16/fp16), ZeRO paper (Rajbhandari et al. 2020, sec. 3.1):
    2 (16-bit weights) + 2 (16-bit grads) + K=12 (fp32 master weights, momentum,
    variance). fp32 training: 4 + 4 + 8 (momentum, variance; no master copy).
    """
    return (4, 4, 8) if precision == "fp32" else (2, 2, 12)


def model_state_bytes(
    num_params: int, precision: str, zero_stage: int, dp: int, model_parallel: int = 1
) -> dict[str, float]:
    """Bytes of weights, grads and optimizer state on one device.

    Tensor and pipeline parallelism split the parameters over `model_parallel`
    = tp*pp devices; ZeRO then shards over the dp replicas: stage 1 the optimizer
    state, stage 2 also the gradients, stage 3 also the weights (FSDP FULL_SHARD;
    SHARD_GRAD_OP is stage 2).
    """
    p, g, k = state_bytes_per_param(precision)
    psi = num_params / model_parallel
    return {
        "params": p * psi / (dp if zero_stage >= 3 else 1),
        "grads": g * psi / (dp if zero_stage >= 2 else 1),
        "optimizer": k * psi / (dp if zero_stage >= 1 else 1),
    }


# --------------------------------------------------------------------------- activations


def activation_bytes_per_layer(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    precision: str = "bf16",
) -> float:
    """Activation memory of one transformer block for one micro batch, in bytes.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", sec. 4, for 16-bit activations and 1-byte dropout masks:
        no parallelism:            s*b*h*(34 + 5*a*s/h)
        tensor parallel (t):       s*b*h*(10 + 24/t + 5*a*s/(h*t))
        + sequence parallel:       s*b*h/t*(34 + 5*a*s/h)
        selective recompute:       the 5*a*s/h term (attention scores) is recomputed
        full recompute:            2*s*b*h (only the block input is kept; /t with SP)
    The constants 34 = 11 (attention) + 19 (MLP) + 4 (two norms) hold for GPT-2
    blocks; for other shapes they are re-derived term by term the same way, with
    the terms the architecture states (trainlab.models.registry.Architecture):
    attention 7 + 4*g with g = kv_heads/heads (K and V shrink under GQA), MLP
    3 + 4*f/h (GELU) or 3 + 8*f/h (SwiGLU: gate, its activation, up, product).
    Of these, 10 (norm inputs, attention and MLP inputs, two dropout masks) are
    replicated under tensor parallelism and the rest is split. fp32 doubles it.
    """
    s, b, h, a = seq_len, micro_batch, m.hidden_size, m.num_heads
    g = (m.num_kv_heads or a) / a
    f_over_h = m.ffn_hidden_size / h
    arch = arch_of(m)
    attention = arch.attention_activation_terms(g)
    mlp = 3 + arch.mlp_activation_factor * f_over_h
    linear_terms = attention + mlp + 4  # 34 for a GPT-2 block
    replicated = 10.0
    scores = 5 * a * s / h
    sbh = s * b * h
    if recompute == "full":
        per_layer = 2 * sbh / (tp if sequence_parallel else 1)
    else:
        if recompute == "selective":
            scores = 0.0
        if sequence_parallel:
            per_layer = sbh / tp * (linear_terms + scores)
        else:
            per_layer = sbh * (replicated + (linear_terms - replicated) / tp + scores / tp)
    return per_layer * (2 if precision == "fp32" else 1)


def activation_bytes(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    precision: str = "bf16",
) -> float:
    """Activation memory on the busiest device for one micro batch, in bytes.

    Layers: with 1F1B pipelining the first stage holds pp micro batches of its
    L/pp layers, i.e. L layers' worth whatever pp is (Korthikanti et al., eq. 5).
    Plus the input-embedding dropout mask (s*b*h*pp/t) and the output side
    (Korthikanti: 4*s*b*h/t*(1 + v/h): final-norm and head inputs, and fp32
    logits for the loss), counted on the same device as a conservative bound.
    """
    per_layer = activation_bytes_per_layer(
        m, seq_len, micro_batch, tp, sequence_parallel, recompute, precision
    )
    s, b, h, v = seq_len, micro_batch, m.hidden_size, m.vocab_size
    embedding = s * b * h * pp / tp
    output = 4 * s * b * h / tp * (1 + v / h)
    return per_layer * m.num_layers + embedding + output


# --------------------------------------------------------------------------- FLOPs


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM (Chowdhery et al. 2022, appendix B):
    6*N + 12*L*H*Q*T, with N the parameters that take part in matmuls (all but
    the lookup tables, the output projection included even when tied; of an
    MoE only the active ones: its router, shared and top_k routed experts), L
    layers, H heads, Q head dim, T sequence length."""
    arch = arch_of(m)
    if arch.measured:  # counted on the model (trainlab.models.measured)
        return arch.flops_per_token(m, seq_len)
    pc = count_params(m)
    n_matmul = pc.non_embedding + (pc.embedding if m.tie_embeddings else 0)
    n_matmul -= pc.total - arch.active_params(m)  # an MoE: the experts a token skips
    return 6 * n_matmul + 12 * m.num_layers * m.num_heads * m.head_dim * seq_len
