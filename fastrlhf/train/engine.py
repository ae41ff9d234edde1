"""fastrlhf's own decode engine for rollouts (`--rollout_engine graph`): a compiled, CUDA-graph captured
decode step over private rollout weights and a pool of KV slots, sampling inside the step; only the
live sequences decode.

What a rollout of N sequences does (N may exceed the S slots of the pool: continuous batching):

1. refresh   the rollout weights are re-formed in place from the policy (same addresses):
             W + s * B @ A in fp32 for every LoRA-wrapped linear, cast once to the engine's dtype,
             q/k/v fused into one matrix and gate/up into another. The trained weights are only read.
2. prefill   the first S sequences' prompts, each distinct prompt once (a GRPO group's G copies share
             one), right-padded to the longest of the call and run eagerly with SDPA's causal kernel
             (no [P, P] score matrix); each prompt's K/V go to slots [0, P_i) of its sequences' cache
             rows, and each sequence draws its first token.
3. decode    replays of one step (compiled with fullgraph=True and static shapes per bucket, on CUDA
             captured once per bucket as a CUDA graph in one memory pool). A step reads each slot's
             last token, writes its K/V at the slot's own length, attends its written slots only
             (ops.decode_attention), samples, and advances tokens, log-probs, lengths and done flags in
             place: no host sync. Every CHECK_EVERY steps the host reads the done flags (on CUDA a copy
             issued at the previous check), refills finished slots with pending sequences, and once none
             are pending moves the live slots to the front and runs the step at the smallest bucket
             (batch size) that holds them.

Randomness is keyed by (seed, sequence, position), never by a slot or the batch, so compaction, refill
and prompt sharing leave the tokens unchanged (tests/train/test_engine.py checks it by equality).

Attention is grouped-query without repeat_kv: each KV head's G = heads / kv_heads query heads are
packed as G queries of that head, so K and V are read at their own head count.

Sampling is exact: token = argmax(logits / T - log E) with E ~ Exp(1) i.i.d. per vocabulary entry,
i.e. argmax(p / E), which draws from p = softmax(logits / T). E comes from a counter-based hash
(`uniform`) keyed by each row's (seed, sequence, column), which the step reads from its state, so a
replay gives fresh draws, on CPU, under torch.compile and inside a CUDA graph alike, and a
rollout is reproducible from its seed (drawn from torch's generator, so torch.manual_seed and
distributed.seed_per_rank apply). The step also keeps the sampler's own log-probs of its tokens.
With --rollout_sampler inverse_cdf the step draws by inversion instead (one 53-bit uniform per row from
the same hash against the float64 running sum of the probabilities: `sample`), the same distribution
for a fraction of the arithmetic where the hash of B x V words costs (one CPU thread).

Supported: the decoder families of MODEL_TYPES (Llama, Qwen2/2.5, Qwen3, Mistral, and the built-in
`tiny`, a Llama) with plain LoRA adapters or none; `unsupported_reason` names what is not.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from fastrlhf import ops
from fastrlhf.train.data import left_pad
from fastrlhf.train.models import lm_head, trunk, unwrap

log = logging.getLogger("fastrlhf")

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # config.model_type of the supported decoder families
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at build time (dynamic / longrope change it)
CHECK_EVERY = 4  # the host reads the slots' done flags every this many decode steps
MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------- support


def _lora_layers(lm):
    """The peft LoRA layers inside `lm` (none for a plain model)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [m for m in lm.modules() if isinstance(m, LoraLayer)]


def unsupported_reason(lm) -> str | None:
    """Why the engine cannot sample from `lm` (a HF causal LM, or a peft model around one), or None."""
    base = unwrap(lm)
    config = base.config
    kind = getattr(config, "model_type", type(base).__name__)
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} is not one the engine implements ({', '.join(MODEL_TYPES)})"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        return (f"rope_type {rope_type!r} changes the rotary frequencies with the length (supported: "
                f"{', '.join(ROPE_TYPES)})")
    for name, p in base.named_parameters():
        if not p.is_floating_point():
            return f"parameter {name} is {p.dtype} (quantized weights are not supported)"
    for layer in _lora_layers(lm):
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) > 1:
            return f"{len(active)} active LoRA adapters (the engine merges one)"
        if any(a in getattr(layer, "lora_variant", {}) for a in active) or any(
                getattr(layer, "use_dora", {}).get(a) for a in active):
            return "a LoRA variant (DoRA or another) that is not a plain W + s * B @ A"
        if getattr(layer, "fan_in_fan_out", False):
            return "LoRA with fan_in_fan_out (Conv1D-style weights)"
    return None


# ---------------------------------------------------------------- shapes and constants


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything the step's arithmetic depends on besides tensors: fixed for an engine (dynamo
    guards on it, so it is part of the compiled step's identity)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    eps: float
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation (transformers' ACT2FN[hidden_act])
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    windows: tuple  # per layer: sliding window (keys at slots > q_slot - window), or None
    rope_scaling: float  # attention_scaling of the rotary embedding (yarn's mscale; 1 otherwise)
    slots: int  # S: rows of the KV pool, sequences decoded at once
    rows: int  # N: sequences per rollout at most (the output buffers)
    prompt_len: int  # P: the longest prompt
    new_tokens: int  # R: tokens sampled per row, EOS included
    temperature: float
    eos_id: int
    fp32_out_mm: bool  # lm_head and attention scores as bf16/fp16 matmuls with fp32 output (CUDA), else cast after
    inverse_cdf: bool = False  # the draw: by inversion (one uniform per row), else the exponential race (`sample`)

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def _config_spec(lm, *, slots: int, rows: int, prompt_len: int, new_tokens: int, temperature: float, eos_id: int,
                 fp32_out_mm: bool, inverse_cdf: bool = False) -> Spec:
    config = unwrap(lm).config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_len = prompt_len + new_tokens
    if config.model_type == "mistral":
        windows = [config.sliding_window] * config.num_hidden_layers
    elif config.model_type in ("qwen2", "qwen3"):
        windows = [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]
    else:
        windows = [None] * config.num_hidden_layers
    windows = tuple(w if w is not None and w < max_len else None for w in windows)  # no effect past the cache
    return Spec(layers=config.num_hidden_layers, heads=heads, kv_heads=config.num_key_value_heads,
                head_dim=head_dim, hidden=config.hidden_size, vocab=config.vocab_size, eps=config.rms_norm_eps,
                act=ACT2FN[config.hidden_act], qk_norm=config.model_type == "qwen3", windows=windows,
                rope_scaling=float(trunk(lm).rotary_emb.attention_scaling), slots=slots, rows=rows,
                prompt_len=prompt_len, new_tokens=new_tokens, temperature=float(temperature), eos_id=int(eos_id),
                fp32_out_mm=fp32_out_mm, inverse_cdf=inverse_cdf)


def rollout_memory_bytes(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                         tied: bool, head_dim: int | None = None, batch: int, max_len: int, dtype_bytes: int = 2,
                         shares_head: bool = False) -> dict[str, int]:
    """Bytes the engine holds (plain arithmetic, for the planner): `weights` (the fused, merged
    layer matrices and norms, the embedding and lm_head unless `shares_head`: LoRA on one process,
    where the frozen base's own tensors are read), `kv_cache` [layers, B, kv_heads, T, head_dim] x 2
    and `logits` (the step's fp32 [B, V]). Biases and Qwen3's q/k norms, a few
    vectors per layer, are left out."""
    d = head_dim or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * intermediate + 2 * hidden
    weights = layers * per_layer + hidden
    if not shares_head:
        weights += vocab * hidden * (1 if tied else 2)
    return {"weights": weights * dtype_bytes, "kv_cache": 2 * layers * batch * kv_heads * max_len * d * dtype_bytes,
            "logits": batch * vocab * 4}


# ---------------------------------------------------------------- weights


@dataclasses.dataclass
class LayerWeights:
    ln1: torch.Tensor  # [H] input RMSNorm
    qkv: torch.Tensor  # [(heads + 2 kv_heads) D, H]: q, k, v stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, heads D]
    o_bias: torch.Tensor | None
    ln2: torch.Tensor  # [H] post-attention RMSNorm
    gate_up: torch.Tensor  # [2 I, H]: gate, up stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None


@dataclasses.dataclass
class Weights:
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    head: torch.Tensor  # [V, H] (the embedding itself when tied)
    head_bias: torch.Tensor | None
    inv_freq: torch.Tensor  # [D / 2] fp32
    layers: list[LayerWeights]
    value: torch.Tensor | None = None  # [1, H] fp32: the critic's value head, read in place (`generate`)
    value_bias: torch.Tensor | None = None


def _linear_parts(m) -> tuple[torch.Tensor, torch.Tensor | None, list]:
    """(base weight, base bias, [(scale, B, A, B's bias)] of the active adapters) of a Linear,
    plain or peft-LoRA-wrapped."""
    if not hasattr(m, "get_base_layer"):
        return m.weight, m.bias, []
    base = m.get_base_layer()
    if m.merged or m.disable_adapters:
        return base.weight, base.bias, []
    deltas = [(m.scaling[a], m.lora_B[a].weight, m.lora_A[a].weight, m.lora_B[a].bias)
              for a in m.active_adapters if a in m.lora_A]
    return base.weight, base.bias, deltas


@torch.no_grad()
def _merged(m) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W + s * B @ A, bias + s * b_B) of a Linear, formed in fp32 (without LoRA: its own tensors)."""
    weight, bias, deltas = _linear_parts(m)
    if not deltas:
        return weight, bias
    w = weight.float()
    b = None if bias is None else bias.float()
    for scale, B, A, b_B in deltas:
        w = torch.addmm(w, B.float(), A.float(), alpha=scale)
        if b_B is not None:
            b = (torch.zeros(w.shape[0], device=w.device) if b is None else b) + scale * b_B.float()
    return w, b


def _has_bias(m) -> bool:
    weight, bias, deltas = _linear_parts(m)
    return bias is not None or any(d[3] is not None for d in deltas)


def _sources(lm) -> tuple[dict, list[dict], list[dict]]:
    """The policy's tensors the rollout weights are formed from: {name: (weight, bias)} of the
    model-wide ones; per layer {name: tensor} of the norms and {name: [Linear, ...]} of the fused
    matrices (their rows stacked in this order)."""
    body, head = trunk(lm), lm_head(lm)
    top = {"embed": (body.embed_tokens.weight, None), "norm": (body.norm.weight, None),
           "head": (head.weight, head.bias)}
    norms, linears = [], []
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norm = {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight}
        if hasattr(attn, "q_norm"):
            norm |= {"q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight}
        norms.append(norm)
        linears.append({"qkv": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
                        "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]})
    return top, norms, linears


@torch.no_grad()
def _merge_into(weight: torch.Tensor, bias: torch.Tensor | None, modules) -> None:
    """Each module's merged weight (and bias, 0 where it has none) into its rows of `weight` / `bias`:
    one fp32 temporary per projection, cast once by the copy."""
    row = 0
    for m in modules:
        w, b = _merged(m)
        rows = slice(row, row + w.shape[0])
        weight[rows].copy_(w)
        if bias is not None and b is not None:
            bias[rows].copy_(b)
        elif bias is not None:
            bias[rows].zero_()
        row += w.shape[0]


# ---------------------------------------------------------------- the arithmetic of a step


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over the last dim (HF's apply_rotary_pos_emb)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> tuple:
    """(cos, sin) [..., D] of integer positions, computed in fp32 and cast, as HF's rotary embedding."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _bmm_fp32(a: torch.Tensor, b: torch.Tensor, spec: Spec) -> torch.Tensor:
    """a @ b (batched) as fp32: bf16/fp16 inputs accumulated and stored in fp32 where that runs (CUDA)."""
    if spec.fp32_out_mm:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b).float()


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      spec: Spec) -> torch.Tensor:
    """q [B, L, heads, D] against k, v [B, kv_heads, T, D] with `allowed` [B, L, T] bool -> [B, L, heads * D],
    for the layers with a sliding window (the others attend through ops.decode_attention). Each KV head's
    G query heads are packed as G * L queries of that head, so K and V are read once, at their own head
    count (no repeat_kv): scores in fp32, softmax in fp32, probabilities @ V in the cache's dtype."""
    B, L = q.shape[:2]
    G, D, KV, T = spec.groups, spec.head_dim, spec.kv_heads, k.shape[2]
    q = q.reshape(B, L, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B * KV, G * L, D)
    scores = _bmm_fp32(q, k.reshape(B * KV, T, D).transpose(1, 2), spec).view(B, KV, G * L, T) * D ** -0.5
    mask = allowed[:, None].expand(B, G, L, T).reshape(B, 1, G * L, T)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    out = torch.bmm(probs.view(B * KV, G * L, T), v.reshape(B * KV, T, D))
    return out.view(B, KV, G, L, D).permute(0, 3, 1, 2, 4).reshape(B, L, spec.heads * D)


def decoder_layer(x, w: LayerWeights, spec: Spec, cos, sin, store, attend):
    """One decoder layer on x [B, L, H]: attention and the gated MLP, with HF's residual stream.
    `store(k, v)` puts the new K/V [B, kv_heads, L, D] in the cache and returns the K/V to attend to;
    `attend(q [B, L, heads, D], k, v)` -> [B, L, heads * D]."""
    B, L, _ = x.shape
    D = spec.head_dim
    qkv = F.linear(rms_norm(x, w.ln1, spec.eps), w.qkv, w.qkv_bias)
    q, k, v = qkv.split([spec.heads * D, spec.kv_heads * D, spec.kv_heads * D], dim=-1)
    q, k, v = q.view(B, L, spec.heads, D), k.view(B, L, spec.kv_heads, D), v.view(B, L, spec.kv_heads, D)
    if spec.qk_norm:
        q, k = rms_norm(q, w.q_norm, spec.eps), rms_norm(k, w.k_norm, spec.eps)
    q, k = rotary(q, cos[:, :, None], sin[:, :, None]), rotary(k, cos[:, :, None], sin[:, :, None])
    k_all, v_all = store(k.transpose(1, 2), v.transpose(1, 2))
    x = x + F.linear(attend(q, k_all, v_all), w.o, w.o_bias)
    gate, up = F.linear(rms_norm(x, w.ln2, spec.eps), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return x + F.linear(spec.act(gate) * up, w.down, w.down_bias)


def heads_of(x: torch.Tensor, weights: Weights, spec: Spec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 [B, V] logits / temperature, fp32 [B] values or None) of the last layer's output x [B, H]:
    the final norm, then the lm_head, and the critic's value head where the engine was given one (on
    h.float(), as fastrlhf.train.heads.ActorCritic)."""
    h = rms_norm(x, weights.norm, spec.eps)
    values = None if weights.value is None else F.linear(h.float(), weights.value, weights.value_bias).squeeze(-1)
    return logits_of(h, weights, spec), values


def logits_of(h: torch.Tensor, weights: Weights, spec: Spec) -> torch.Tensor:
    """fp32 [B, V] logits / temperature of the final-normed hidden states h [B, H]."""
    if spec.fp32_out_mm:
        logits = torch.mm(h, weights.head.t(), out_dtype=torch.float32)
        if weights.head_bias is not None:
            logits = logits + weights.head_bias.float()
    else:
        logits = F.linear(h, weights.head, weights.head_bias).float()
    return logits if spec.temperature == 1.0 else logits / spec.temperature


# ---------------------------------------------------------------- sampling


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 0 <= x < 2^32 without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash on int64 0 <= x < 2^32 (C. Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, seq: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^32) [B] of the draws of sequences `seq` [B] at columns `col` [B] (int64, each
    < 2^32) under `seed` (int64 in [0, 2^32), 0-d or [1]): a chain of hash32, so a token's random numbers
    depend on (seed, sequence, position) only, never on the row's slot or the batch around it."""
    return hash32(hash32(seed ^ hash32(seq)) ^ col)


def random_bits(keys: torch.Tensor, width: int) -> torch.Tensor:
    """int64 words in [0, 2^32) [B, width] for the row keys [B] (`row_keys`): two rounds of hash32
    keyed by the row's key, over the column index."""
    k = keys[:, None]
    idx = torch.arange(width, device=keys.device, dtype=torch.int64)
    return hash32((hash32(idx ^ k) + k) & MASK32)


def uniform(keys: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 uniforms in (0, 1) [B, width] from `random_bits`. Values near 0 keep float precision (down
    to 2^-33): they are the small E = -log1p(-u) that decide rare tokens."""
    return ((random_bits(keys, width).float() + 0.5) * 2.0 ** -32).clamp(max=1.0 - 2.0 ** -24)


def uniform64(keys: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1] [B, 1], one per row from two words of `random_bits` (2^-53 apart
    everywhere, as torch.rand's float64: inversion needs the resolution at every height, not only near 0;
    1.0 only when the 64 bits round up to it)."""
    h = random_bits(keys, 2).double()
    return (h[:, :1] * 2.0 ** 32 + h[:, 1:]) * 2.0 ** -64


def draw_by_inversion(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B, 1] long, its log-prob [B, 1] fp32) drawn from softmax(x) [B, V] (fp32) by inversion with
    u [B, 1] float64 uniforms in [0, 1]: the first token whose float64 running sum of exp(x - max) passes
    u x the total, kept below the total (so a token of probability 0, which adds nothing to the sum, is
    never drawn); log-prob x[token] - max - log(total). A row with a NaN or +inf logit gets a NaN log-prob.
    Shared by the graph engine's step and generate's logits processor (fastrlhf.train.rollout.InverseCDF)."""
    top = x.amax(-1, keepdim=True)
    cdf = (x - top).exp_().double().cumsum_(-1)  # unnormalised: u is scaled to the total
    total = cdf[:, -1:]
    token = torch.searchsorted(cdf, torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total))),
                               right=True).clamp_(max=x.shape[-1] - 1)  # a NaN row searches past the end
    return token, (x.gather(-1, token) - top - total.log()).float()


def sample(scores: torch.Tensor, keys: torch.Tensor, inverse_cdf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B]) drawn from softmax(scores) [B, V] (fp32, temperature applied) with
    the random numbers of the row keys [B] (`row_keys`). The exponential race: argmax(scores - log E),
    E = -log1p(-u) ~ Exp(1), i.e. argmax(p / E), one uniform per vocabulary entry. `inverse_cdf`:
    `draw_by_inversion`, one uniform per row; ~5x less arithmetic per step on one CPU thread, where the
    hash of B x V words is most of a small model's step."""
    if not inverse_cdf:
        noise = -torch.log(-torch.log1p(-uniform(keys, scores.shape[-1])))
        token = torch.argmax(scores + noise, dim=-1)
        return token, scores.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scores, dim=-1)
    token, logp = draw_by_inversion(scores, uniform64(keys))
    return token.squeeze(-1), logp.squeeze(-1)


# ---------------------------------------------------------------- state

SLOT_FIELDS = ("length", "last", "seq", "col", "limit", "done")  # per slot: permuted by compaction, sliced by a bucket


@dataclasses.dataclass
class State:
    """Every tensor a rollout reads or advances; allocated once per engine and reused (the same
    addresses for every rollout, so captured graphs stay valid). A slot holds one sequence at a time:
    its prompt's K/V at slots [0, P_s) of its cache row, then one slot per token read."""

    k_cache: list[torch.Tensor]  # per layer [S, kv_heads, T, D] (separate tensors: a step updates each in place)
    v_cache: list[torch.Tensor]
    length: torch.Tensor  # [S] long: KV slots written; the token the next step reads sits at this position
    last: torch.Tensor  # [S] long: the token the next step reads
    seq: torch.Tensor  # [S] long: the sequence (row of the outputs) the slot holds; `rows` (scratch) when none
    col: torch.Tensor  # [S] long: tokens sampled for it so far
    limit: torch.Tensor  # [S] long: the most tokens it may sample (new_tokens, or its own limit)
    done: torch.Tensor  # [S] bool: EOS sampled, its limit reached, or no sequence
    tokens: torch.Tensor  # [N + 1, R] long: sampled tokens per sequence (row N: what finished slots write)
    logps: torch.Tensor  # [N + 1, R] fp32: their log-probs under the sampler
    values: torch.Tensor  # [N + 1, R] fp32: the value head's at the state before each token (with a value head)
    ends: torch.Tensor  # [N + 1] long: tokens sampled per sequence
    seed: torch.Tensor  # [1] long
    kv_read: torch.Tensor  # [1] long: KV slots attended, summed over the decode steps' rows (a work count)

    @classmethod
    def allocate(cls, spec: Spec, dtype, device) -> State:
        S, N, R, T = spec.slots, spec.rows, spec.new_tokens, spec.max_len
        cache = (S, spec.kv_heads, T, spec.head_dim)

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(k_cache=[zeros(*cache, dtype=dtype) for _ in range(spec.layers)],
                   v_cache=[zeros(*cache, dtype=dtype) for _ in range(spec.layers)],
                   length=zeros(S), last=zeros(S), seq=zeros(S), col=zeros(S), limit=zeros(S),
                   done=zeros(S, dtype=torch.bool),
                   tokens=zeros(N + 1, R), logps=zeros(N + 1, R, dtype=torch.float32),
                   values=zeros(N + 1, R, dtype=torch.float32), ends=zeros(N + 1), seed=zeros(1), kv_read=zeros(1))

    def head(self, b: int) -> State:
        """The first b slots (views: what a step of bucket b reads and writes); the outputs whole."""
        return dataclasses.replace(self, k_cache=[k[:b] for k in self.k_cache], v_cache=[v[:b] for v in self.v_cache],
                                   **{name: getattr(self, name)[:b] for name in SLOT_FIELDS})

    def permute(self, order: torch.Tensor) -> None:
        """Slot order[i] moves to slot i (i < len(order)), in place: caches and per-slot state."""
        n = order.numel()
        for t in self.k_cache + self.v_cache + [getattr(self, name) for name in SLOT_FIELDS]:
            t[:n].copy_(t.index_select(0, order))

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out += value if isinstance(value, list) else [value]
        return out


def _window_mask(q_pos: torch.Tensor, T: int, window: int) -> torch.Tensor:
    """[B, L, T] bool: the key slots inside the sliding window of each query at positions q_pos [B, L]:
    slots in (q_pos - window, q_pos] (causal; in decode every slot <= q_pos is written)."""
    slots = torch.arange(T, device=q_pos.device)
    return (slots <= q_pos[..., None]) & (slots > q_pos[..., None] - window)


@torch.no_grad()
def prefill(weights: Weights, state: State, spec: Spec, prompts: list[list[int]], which: torch.Tensor,
            slots: torch.Tensor, seqs: torch.Tensor, limits: torch.Tensor, pad_id: int) -> tuple[int, int]:
    """Start sequences `seqs` [m] in `slots` [m], sequence i from prompt which[i] of the distinct `prompts`:
    each distinct prompt is run once (right-padded to the longest of this call; causal attention over
    left-aligned prompts never sees the padding after them: SDPA's fused causal kernel, no [P, P] score
    matrix), its K/V copied to the slots of its sequences, and each sequence draws its first token from
    the prompt's last logits with its own random numbers; `limits` [m] are the sequences' most tokens.
    Returns (prompt rows run, tokens run)."""
    device = state.length.device
    n = torch.tensor([len(p) for p in prompts], device=device)
    P = max(map(len, prompts))
    ids = torch.tensor([p + [pad_id] * (P - len(p)) for p in prompts], device=device)
    positions = torch.arange(P, device=device)
    cos, sin = rotary_tables(positions[None], weights.inv_freq, spec.rope_scaling, weights.embed.dtype)
    x = weights.embed[ids]
    for i, w in enumerate(weights.layers):
        def store(k, v, k_cache=state.k_cache[i], v_cache=state.v_cache[i]):  # the prompts' K/V into their slots
            for at in range(0, len(slots), len(prompts)):  # a gathered copy of no more rows than k itself has
                chunk = slice(at, at + len(prompts))
                k_cache[slots[chunk], :, :P] = k[which[chunk]]
                v_cache[slots[chunk], :, :P] = v[which[chunk]]
            return k, v

        window = spec.windows[i]

        def attend(q, k, v, window=window):
            mask = None if window is None else _window_mask(positions[None], P, window)[:, None]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=spec.groups > 1)
            return out.transpose(1, 2).reshape(q.shape[0], P, spec.heads * spec.head_dim)

        x = decoder_layer(x, w, spec, cos, sin, store, attend)
    logits, values = heads_of(x[torch.arange(len(prompts), device=device), n - 1], weights, spec)
    token, logp = sample(logits[which], row_keys(state.seed, seqs, torch.zeros_like(seqs)), spec.inverse_cdf)
    state.tokens[seqs, 0] = token
    state.logps[seqs, 0] = logp
    state.ends[seqs] = 1
    if values is not None:
        state.values[seqs, 0] = values[which]
    state.length[slots] = n[which]
    state.last[slots] = token
    state.seq[slots] = seqs
    state.col[slots] = 1
    state.limit[slots] = limits
    state.done[slots] = (token == spec.eos_id) | (limits <= 1)
    return len(prompts), len(prompts) * P


def decode_step(weights: Weights, state: State, spec: Spec) -> None:
    """One token for every slot of `state` (a bucket's view, `State.head`), entirely in place (static
    shapes, no host sync): the body that is compiled and captured, once per bucket. Each slot writes
    its K/V at its own length and attends its written slots only (ops.decode_attention); a finished
    slot still computes (until the host drops it) but changes nothing: its writes go past its length
    and to the scratch row of the outputs."""
    live = ~state.done
    pos = state.length.clamp(max=spec.max_len - 1)  # the slot and position of the token read
    rows = torch.arange(pos.shape[0], device=pos.device)
    cos, sin = rotary_tables(pos[:, None], weights.inv_freq, spec.rope_scaling, weights.embed.dtype)
    x = weights.embed[state.last][:, None]  # [b, 1, H]
    for i, w in enumerate(weights.layers):
        def store(k, v, k_cache=state.k_cache[i], v_cache=state.v_cache[i]):  # at each slot's own length
            k_cache[rows, :, pos] = k[:, :, 0]
            v_cache[rows, :, pos] = v[:, :, 0]
            return k_cache, v_cache

        window = spec.windows[i]

        def attend(q, k, v, window=window):
            if window is not None:
                return grouped_attention(q, k, v, _window_mask(pos[:, None], spec.max_len, window), spec)
            out = ops.decode_attention(q.transpose(1, 2), k, v, pos + 1, scale=spec.head_dim ** -0.5)
            return out.transpose(1, 2).reshape(q.shape[0], 1, spec.heads * spec.head_dim)

        x = decoder_layer(x, w, spec, cos, sin, store, attend)
    logits, values = heads_of(x[:, 0], weights, spec)
    token, logp = sample(logits, row_keys(state.seed, state.seq, state.col), spec.inverse_cdf)
    out = torch.where(live, state.seq, spec.rows)
    col = state.col.clamp(max=spec.new_tokens - 1)
    state.tokens[out, col] = token
    state.logps[out, col] = logp
    if values is not None:
        state.values[out, col] = values
    state.last.copy_(torch.where(live, token, state.last))
    state.length.add_(live.long())
    state.col.add_(live.long())
    state.ends[out] = state.col
    state.done.logical_or_((token == spec.eos_id) | (state.col >= state.limit))
    state.kv_read.add_((pos + 1).sum())


def buckets_for(slots: int, smallest: int = 8) -> tuple[int, ...]:
    """The batch sizes the decode step runs at (one compiled graph and CUDA graph each, as vLLM's
    capture sizes): powers of two from `smallest`, and `slots` itself."""
    sizes, b = [], smallest
    while b < slots:
        sizes.append(b)
        b *= 2
    return (*sizes, slots)


# ---------------------------------------------------------------- the engine


def _mm_has_fp32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm and torch.bmm(a, b, out_dtype=torch.float32) run here for `dtype` inputs (CUDA,
    recent torch): then logits and attention scores are accumulated and stored in fp32, not rounded
    to `dtype` first."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(2, 2, device=device, dtype=dtype)
        return (torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
                and torch.bmm(a[None], a[None], out_dtype=torch.float32).dtype == torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class DecodeEngine:
    """Rollouts of up to `batch` sequences, prompts of at most `prompt_len` tokens, `new_tokens` sampled
    tokens per sequence, decoded `slots` at a time. `generate(lm, ...)` refreshes the rollout weights
    from `lm`, prefills each distinct prompt once, decodes.

    slots       the KV pool's rows: at most this many sequences decode at once; a finished one's slot
                is refilled with the next pending sequence (continuous batching). Default: batch
    dtype       the rollout weights' and cache's dtype: bf16 on CUDA (what the HF path computes in
                under autocast), the model's own dtype elsewhere
    compile     torch.compile(decode_step, fullgraph=True): one graph, dynamic in the slot dimension
                (marked on every bucket's views of size >= 2), serves every bucket (a bucket of 1 gets
                its own), so more buckets cost captures, not compiles; False runs the same function
                eagerly (tests)
    cuda_graph  capture the compiled step once per bucket as a CUDA graph, in one memory pool, and
                replay it (CUDA only)
    buckets     the batch sizes a step runs at (`buckets_for(slots)`): the live slots are compacted to
                the front and the step runs at the smallest bucket that holds them
    check_every the host reads the slots' done flags every this many steps (on CUDA the copy issued at
                the previous check, so the host never waits for the step it just launched)
    share_frozen  read the embedding / lm_head of the policy in place when they are frozen, of the
                engine's dtype and persistent (one process, LoRA): no copy of 2 x V x H
    inverse_cdf  draw by inversion, one uniform per row (--rollout_sampler inverse_cdf), instead of
                the exponential race over one uniform per vocabulary entry (`sample`)
    share_prompts  prefill equal prompts started together (a GRPO group) once, their K/V copied to each
                sequence's slot; False prefills every sequence's own (the same tokens: a test's baseline)
    keep_memory  keep the KV pool, the weight copy and the CUDA graphs between rollouts; False: `release`
                them at the end of each `generate` (the trainer's default, --rollout_keep_memory), so the
                update has that memory, and re-form them at the next
    """

    def __init__(self, lm, *, batch: int, prompt_len: int, new_tokens: int, temperature: float, eos_id: int,
                 pad_id: int, device: torch.device, dtype: torch.dtype | None = None, compile: bool = True,
                 cuda_graph: bool | None = None, share_frozen: bool = True, inverse_cdf: bool = False,
                 slots: int | None = None, buckets: tuple[int, ...] | None = None, check_every: int = CHECK_EVERY,
                 share_prompts: bool = True, keep_memory: bool = True):
        reason = unsupported_reason(lm)
        if reason is not None:
            raise ValueError(f"rollout engine: {reason}")
        slots = batch if slots is None else slots
        for name, value in (("batch", batch), ("prompt_len", prompt_len), ("new_tokens", new_tokens),
                            ("slots", slots), ("check_every", check_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"rollout engine: {name} must be a positive int, got {value!r}")
        if temperature <= 0:
            raise ValueError(f"rollout engine: temperature must be > 0, got {temperature}")
        slots = min(slots, batch)
        self.buckets = tuple(sorted(set(buckets_for(slots) if buckets is None else buckets)))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] != slots:
            raise ValueError(f"rollout engine: buckets must be positive sizes ending at slots = {slots}, "
                             f"got {buckets!r}")
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else lm_head(lm).weight.dtype)
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError("rollout engine: cuda_graph needs a CUDA device")
        self.pad_id = pad_id
        self.share_frozen = share_frozen
        self.check_every = check_every
        self.share_prompts = share_prompts
        self.keep_memory = keep_memory
        fp32_mm = self.dtype in (torch.bfloat16, torch.float16) and _mm_has_fp32_out(self.device, self.dtype)
        self.spec = _config_spec(lm, slots=slots, rows=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                                 temperature=temperature, eos_id=eos_id, fp32_out_mm=fp32_mm,
                                 inverse_cdf=inverse_cdf)
        self.weights: Weights | None = None
        self.shared: list[torch.Tensor] = []  # the policy's own tensors the engine reads in place
        self.copied: list[str] = []  # the model-wide tensors (embed, head, norm) refresh copies
        self.compiled = compile
        self.state: State | None = None
        self._allocate_state()
        self.step = torch.compile(decode_step, fullgraph=True, dynamic=None if self._dynamic_buckets() else False) \
            if compile else decode_step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._compiled: set[int] = set()  # the buckets whose step has been compiled (CPU, no graphs)
        self.flags = torch.zeros(slots, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        self.event = torch.cuda.Event() if self.device.type == "cuda" else None
        self.stats = {"compile_s": 0.0, "capture_s": 0.0, "refresh_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0,
                      "decode_steps": 0, "captures": 0, "releases": 0}

    def _dynamic_buckets(self) -> list[int]:
        """The buckets one compiled graph serves, dynamic in the slot dimension (size 1 is always
        specialized by dynamo); none when there is at most one such bucket (a static compile)."""
        shared = [b for b in self.buckets if b >= 2]
        return shared if self.compiled and len(shared) > 1 else []

    def _allocate_state(self) -> None:
        """The KV pool and per-rollout buffers, and each bucket's views of them. One compile serves every
        bucket: a static-shape compile of qwen2-0.5b's step took 38 s on an H200
        (bench/results/2026-12-04-h200-rollout_lengths.json), so six buckets would take minutes."""
        self.state = State.allocate(self.spec, self.dtype, self.device)
        self.views = {b: self.state.head(b) for b in self.buckets}
        dynamic = self._dynamic_buckets()
        for b in dynamic:
            view = self.views[b]
            for t in view.k_cache + view.v_cache + [getattr(view, name) for name in SLOT_FIELDS]:
                torch._dynamo.mark_dynamic(t, 0, min=dynamic[0], max=self.spec.slots)

    def release(self) -> None:
        """Free what the engine holds between rollouts, for the update: the KV pool and the other
        per-rollout buffers, its own copy of the weights (the policy's tensors it reads in place stay the
        policy's) and the CUDA graphs with their memory pool. The compiled step is kept: the next
        `generate` allocates the same shapes again (no recompile), re-forms the weights (as every rollout
        does) and re-captures the graphs (stats["captures"] counts the captures, "capture_s" their time)."""
        self.graphs.clear()
        self.views = {}
        self.state = None
        self.weights = None
        self.shared, self.copied = [], []
        self.stats["releases"] += 1

    # ------------------------------------------------------------ weights

    @torch.no_grad()
    def refresh(self, lm) -> None:
        """Re-form the rollout weights from `lm` in place (the same tensors, so a captured graph reads
        the new values): merged LoRA in fp32, cast once. The first call allocates them."""
        t0 = time.perf_counter()
        top, norms, linears = _sources(lm)
        if self.state is None:
            self._allocate_state()
        if self.weights is None:
            self.weights = self._allocate(lm, top, norms, linears)
        w = self.weights
        for name in self.copied:
            getattr(w, name).copy_(top[name][0])
        if w.head_bias is not None:
            w.head_bias.copy_(top["head"][1])
        for lw, norm, linear in zip(w.layers, norms, linears):
            for name, tensor in norm.items():
                getattr(lw, name).copy_(tensor)
            for name, modules in linear.items():
                _merge_into(getattr(lw, name), getattr(lw, f"{name}_bias"), modules)
        self.stats["refresh_s"] = time.perf_counter() - t0
    def _allocate(self, lm, top: dict, norms: list[dict], linears: list[dict]) -> Weights:
        """The engine's own tensors (empty; `refresh` fills them). The embedding and an untied lm_head
        are read from the policy in place where that is safe (`share_frozen`, frozen, of the engine's
        dtype and device); a tied lm_head is the embedding."""

        def empty(*shape):
            return torch.empty(shape, dtype=self.dtype, device=self.device)

        def model_wide(name):
            t = top[name][0]
            if self.share_frozen and not t.requires_grad and t.dtype == self.dtype and t.device == self.device:
                self.shared.append(t)
                return t
            self.copied.append(name)
            return empty(*t.shape)

        embed = model_wide("embed")
        head = embed if lm_head(lm).weight is trunk(lm).embed_tokens.weight else model_wide("head")
        self.copied.append("norm")
        head_bias = None if top["head"][1] is None else empty(*top["head"][1].shape)
        layers = []
        for norm, linear in zip(norms, linears):
            fields = {f.name: None for f in dataclasses.fields(LayerWeights)}
            fields |= {name: empty(*t.shape) for name, t in norm.items()}
            for name, modules in linear.items():
                rows = sum(_linear_parts(m)[0].shape[0] for m in modules)
                fields[name] = empty(rows, _linear_parts(modules[0])[0].shape[1])
                fields[f"{name}_bias"] = empty(rows) if any(map(_has_bias, modules)) else None
            layers.append(LayerWeights(**fields))
        inv_freq = trunk(lm).rotary_emb.inv_freq.detach().float().to(self.device).clone()
        weights = Weights(embed, empty(*top["norm"][0].shape), head, head_bias, inv_freq, layers)
        if not self.stats["releases"]:  # said once, not at every re-allocation after a release
            log.info("rollout engine: %s", self.memory_summary(weights))
        return weights

    def memory_bytes(self, weights: Weights | None = None) -> dict[str, int]:
        """Bytes the engine holds: `weights` (its own rollout weights), `weights_shared` (read from the
        policy in place, no extra memory), `kv_cache`, `state` (the rest of the per-rollout buffers).
        The weights are allocated by the first rollout: 0 before it."""
        weights = weights or self.weights
        shared = {t.data_ptr() for t in self.shared}
        tensors = [] if weights is None else [weights.embed, weights.norm, weights.head, weights.head_bias]
        tensors += [getattr(lw, f.name) for lw in (weights.layers if weights else []) for f in dataclasses.fields(lw)]
        unique = {t.data_ptr(): t.nbytes for t in tensors if t is not None}
        st = self.state
        kv = 0 if st is None else sum(t.nbytes for t in st.k_cache + st.v_cache)
        return {"weights": sum(b for p, b in unique.items() if p not in shared),
                "weights_shared": sum(b for p, b in unique.items() if p in shared), "kv_cache": kv,
                "state": 0 if st is None else sum(t.nbytes for t in st.tensors()) - kv}

    def memory_summary(self, weights: Weights | None = None) -> str:
        m, s = self.memory_bytes(weights), self.spec
        mib = 2 ** 20
        shared = f", {m['weights_shared'] / mib:.1f} MiB read in place from the frozen policy" \
            if m["weights_shared"] else ""
        return (f"{m['weights'] / mib:.1f} MiB of {str(self.dtype).removeprefix('torch.')} rollout weights (LoRA "
                f"merged, q/k/v and gate/up fused){shared}; KV cache {m['kv_cache'] / mib:.1f} MiB for {s.slots} slots "
                f"x {s.max_len} positions ({s.prompt_len} prompt + {s.new_tokens} new); other state "
                f"{m['state'] / mib:.1f} MiB")

    # ------------------------------------------------------------ a rollout

    @torch.no_grad()
    def generate(self, lm, prompt_ids: list[list[int]], value_head: torch.nn.Linear | None = None,
                 limits: list[int] | None = None) -> tuple:
        """Sample for `prompt_ids` (at most `batch` sequences of 1 to `prompt_len` tokens) with the
        weights of `lm`: (prompt ids [n, P'] and mask, left-padded to the longest prompt; sampled
        tokens [n, R'], 0 after a sequence's end (its length, EOS included, in `self.ends` [n]); the
        sampler's log-probs [n, R'] fp32; the values [n, R'] fp32 of `value_head` (a critic's [H -> 1]
        head on the same trunk, read in place: what its forward over the rollout gives, up to
        rounding), or None). R' is the longest sequence's length (EOS included, at most new_tokens).
        Equal prompts (a GRPO group) are prefilled once.
        Sequence i's tokens depend on (seed, i, position) only: not on the slots, the buckets, or the
        other sequences. `limits`: each sequence's most tokens (<= new_tokens; the bench's drawn lengths,
        with an EOS the model never samples). Whether a value head is given is fixed by the first call
        (a captured step reads it)."""
        s = self.spec
        n = len(prompt_ids)
        if not 1 <= n <= s.rows:
            raise ValueError(f"rollout engine: got {n} prompts for an engine of batch {s.rows}")
        shortest, longest = min(map(len, prompt_ids)), max(map(len, prompt_ids))
        if longest > s.prompt_len:
            raise ValueError(f"rollout engine: a prompt of {longest} tokens, longer than prompt_len {s.prompt_len}")
        if shortest < 1:
            raise ValueError("rollout engine: an empty prompt (each needs at least one token)")
        limits = [s.new_tokens] * n if limits is None else list(limits)
        if len(limits) != n or any(not isinstance(x, int) or not 1 <= x <= s.new_tokens for x in limits):
            raise ValueError(f"rollout engine: limits must be {n} ints in [1, new_tokens = {s.new_tokens}]")
        self.refresh(lm)
        if self.graphs and (value_head is None) != (self.weights.value is None):
            raise ValueError("rollout engine: the first rollout was captured " +
                             ("without" if value_head is not None else "with") + " a value head")
        if value_head is not None:
            self.weights.value, self.weights.value_bias = value_head.weight, value_head.bias
        else:
            self.weights.value = self.weights.value_bias = None
        prompts = [list(p) for p in prompt_ids]
        self.limits = limits
        self.state.seed.fill_(int(torch.randint(0, 2 ** 32, (1,))))
        if self.cuda_graph and not self.graphs:
            self._reset(n)
            self._start(prompts, list(range(min(n, s.slots))), list(range(min(n, s.slots))))
            self._capture()  # the warm-up steps advance that state; the rollout below starts afresh
        self._reset(n)
        t0 = time.perf_counter()
        self._run(prompts)
        st = self.state
        tokens = st.tokens[:n]
        self.ends = st.ends[:n].clone()
        columns = int(self.ends.max())
        self.stats["tokens"] = int(self.ends.sum())
        self.stats["kv_read"] = int(st.kv_read)
        self.stats["decode_s"] = time.perf_counter() - t0 - self.stats["prefill_s"]
        held = self.memory_bytes()
        self.stats["held_bytes"] = held["weights"] + held["kv_cache"] + held["state"]  # freed by `release`
        ids, mask = left_pad(prompts, self.pad_id)
        out = (ids.to(self.device), mask.to(self.device), tokens[:, :columns].clone(), st.logps[:n, :columns].clone(),
               None if value_head is None else st.values[:n, :columns].clone())
        if not self.keep_memory:
            self.release()
        return out

    def _reset(self, n: int) -> None:
        """No sequence in any slot; the outputs of the n sequences cleared; the counters at 0."""
        st = self.state
        for t in (st.tokens, st.logps, st.values, st.ends):
            t[:n].zero_()
        st.done.fill_(True)
        st.seq.fill_(self.spec.rows)
        st.length.zero_()
        st.col.zero_()
        st.kv_read.zero_()
        self.stats |= {"prefill_s": 0.0, "decode_steps": 0, "row_steps": 0, "occupied_row_steps": 0,
                       "prefill_rows": 0, "prefill_tokens": 0, "prefills": 0, "compactions": 0,
                       "kv_slots": self.spec.slots * self.spec.max_len}

    def _start(self, prompts: list[list[int]], seqs: list[int], slots: list[int]) -> None:
        """Prefill sequences `seqs` into `slots`: each distinct prompt among them once."""
        t0 = time.perf_counter()
        distinct: dict[tuple, int] = {}
        key = (lambda i: tuple(prompts[i])) if self.share_prompts else (lambda i: i)
        which = [distinct.setdefault(key(i), len(distinct)) for i in seqs]
        first = {w: i for i, w in reversed(list(zip(seqs, which)))}  # a sequence of each distinct prompt

        def device(values):
            return torch.tensor(values, dtype=torch.long, device=self.device)

        with torch.profiler.record_function("fastrlhf::prefill"):
            rows, tokens = prefill(self.weights, self.state, self.spec, [prompts[first[w]] for w in range(len(first))],
                                   device(which), device(slots), device(seqs),
                                   device([self.limits[i] for i in seqs]), self.pad_id)
        self.stats["prefill_rows"] += rows
        self.stats["prefill_tokens"] += tokens
        self.stats["prefills"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds `rows` slots."""
        return next(b for b in self.buckets if b >= rows)

    @torch.no_grad()
    def _run(self, prompts: list[list[int]]) -> None:
        """Decode every sequence to its end, `slots` at a time. Every `check_every` steps the host reads
        which slots are done (`_poll`), frees them and refills them with pending sequences; once none are
        pending and the live slots fit a smaller bucket, they move to the front (`State.permute`) and the
        step runs at that bucket."""
        n, S = len(prompts), self.spec.slots
        holder = [-1] * S  # the host's view: the sequence each slot holds, -1 for none
        first = min(n, S)
        self._start(prompts, list(range(first)), list(range(first)))
        holder[:first] = range(first)
        pending = first  # the next sequence to start
        self._poll_snapshot = None
        b = self.bucket(first)
        while True:
            occupied = sum(h >= 0 for h in holder[:b])
            for _ in range(self.check_every):
                self._run_step(b)
            self.stats["decode_steps"] += self.check_every
            self.stats["row_steps"] += self.check_every * b
            self.stats["occupied_row_steps"] += self.check_every * occupied
            finished = self._poll(holder)
            holder = [-1 if h in finished else h for h in holder]
            free = [i for i, h in enumerate(holder) if h < 0]
            if pending < n and free:
                take = free[:n - pending]
                seqs = list(range(pending, pending + len(take)))
                self._start(prompts, seqs, take)
                for slot, seq in zip(take, seqs):
                    holder[slot] = seq
                pending += len(take)
            live = [i for i, h in enumerate(holder) if h >= 0]
            if not live and pending == n:
                break
            if pending == n and self.bucket(len(live)) < self.bucket(live[-1] + 1):
                self._compact(live)
                holder = [holder[i] for i in live] + [-1] * (S - len(live))
                live = list(range(len(live)))
            b = self.bucket(live[-1] + 1)

    def _poll(self, holder: list[int]) -> set[int]:
        """The sequences the host now knows are done. On CPU the flags are read as they are; on CUDA
        from the copy issued at the previous check (its event has long passed: no wait on the step just
        launched), mapped through the slots' holders at that time (a compaction or refill since then
        moved them)."""
        done = self.state.done
        if self.event is None:
            return {h for h, d in zip(holder, done.tolist()) if d and h >= 0}
        finished = set()
        if self._poll_snapshot is not None:
            self.event.synchronize()
            finished = {h for h, d in zip(self._poll_snapshot, self.flags.tolist()) if d and h >= 0}
        self.flags.copy_(done, non_blocking=True)
        self.event.record()
        self._poll_snapshot = list(holder)
        return finished

    def _compact(self, live: list[int]) -> None:
        """Move the live slots to the front, in order; the slots after them hold nothing."""
        st = self.state
        st.permute(torch.tensor(live, dtype=torch.long, device=self.device))
        st.done[len(live):] = True
        st.seq[len(live):] = self.spec.rows
        self.stats["compactions"] += 1

    def _run_step(self, b: int) -> None:
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            return
        if self.compiled and not self.cuda_graph and b not in self._compiled:
            t0 = time.perf_counter()  # the first call at a bucket compiles (a real step all the same): timed apart
            self.step(self.weights, self.views[b], self.spec)
            self.stats["compile_s"] += time.perf_counter() - t0
            self._compiled.add(b)
            return
        self.step(self.weights, self.views[b], self.spec)

    def _capture(self) -> None:
        """Compile every bucket's step (3 warm-up calls each on a side stream; after a `release` the
        compiled step is reused and this is warm-up alone, counted in capture_s), then capture each as a
        CUDA graph, largest first, in one memory pool."""
        first = self.stats["captures"] == 0
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in reversed(self.buckets):
                for _ in range(3):
                    self.step(self.weights, self.views[b], self.spec)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.stats["compile_s" if first else "capture_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step(self.weights, self.views[b], self.spec)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.stats["capture_s"] += time.perf_counter() - t0
        self.stats["captures"] += len(self.graphs)
        log.info("rollout engine: decode step compiled in %.1f s, captured as %d CUDA graphs (batch sizes %s) in "
                 "%.2f s", self.stats["compile_s"], len(self.graphs), ", ".join(map(str, self.buckets)),
                 self.stats["capture_s"])
