"""Attention of the scoring and training forwards (PPO's phases 3 and 5), as the host planned it.

transformers builds each forward's mask from the 2-D attention mask or the position_ids, and on
the way reads the device to decide what it can skip (transformers 5.x `masking_utils`:
`_ignore_causal_mask_sdpa` reads `fast_all(padding_mask)`, `find_packed_sequence_indices` reads
whether the position_ids restart): a host sync in every forward. The host already knows what each
micro-batch holds (fastrlhf.train.packing), so those forwards are planned instead:

`install(model)` gives the model the attention implementation `fastrlhf-<its own>` (registered with
transformers' AttentionInterface, with its own implementation's mask function): a forward that is
not planned (generation, evaluation) runs exactly as before, through the model's own attention
function and transformers' mask. A planned forward (`models.hidden_states(..., attention=...)`)
passes a 4-D placeholder as its mask (transformers takes a 4-D mask as prepared: it builds none
and reads nothing) and its plan as keyword arguments, which reach `attention` in every layer,
gradient checkpointing's recomputation included:
- padded rows: `fastrlhf_mask`, the 4-D causal & key-padding mask transformers would build, through
  transformers' `sdpa_attention_forward` (the same numbers), or nothing when no row is padded
  (SDPA's is_causal: its flash kernel on CUDA);
- a pack (sequences end to end): `cu_seq_lens_q` [n_seq + 1] int32 and `max_length_q` (a host int),
  per-sequence causal attention by a varlen kernel on CUDA: flash-attn's `flash_attn_varlen_func`
  where flash-attn is installed, else PyTorch's own (`torch.nn.attention.varlen.varlen_attn`);
  without one (the CPU) `fastrlhf_mask`, the block-diagonal causal mask, through SDPA;
- a shared-prompt pack (units [prompt, response 1, ..., response k], each response seeing its unit's
  prompt and itself, causally): on CUDA `fastrlhf_block_mask`, flex attention's BlockMask, made
  block-sparse from the tokens' segments without a dense [N, N] mask, through transformers'
  `flex_attention_forward` (its compiled flex_attention); on the CPU `fastrlhf_mask`, the same mask as
  a 4-D bool [1, 1, N, N] through SDPA (dense: fine at the CPU's sizes).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "fastrlhf-"  # fastrlhf-sdpa, fastrlhf-flash_attention_2, ...


@functools.cache
def varlen_kernel():
    """(name, fn) of the varlen attention kernel for packs on CUDA: flash-attn's where it is installed,
    else PyTorch's (torch.nn.attention.varlen, in recent releases); None without either.
    fn(q, k, v [N, heads, D], cu_seqlens, max_length, scale) -> [N, heads, D]: causal within each
    sequence, GQA (fewer key/value heads) included."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        pass
    else:
        def flash(q, k, v, cu, max_length, scale):  # GQA natively
            return flash_attn_varlen_func(q, k, v, cu, cu, max_length, max_length, 0.0, softmax_scale=scale,
                                          causal=True)

        return "flash_attn.flash_attn_varlen_func", flash
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters  # its keywords changed between torch releases
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    native_gqa, takes_scale = "enable_gqa" in params, "scale" in params

    def torch_varlen(q, k, v, cu, max_length, scale):
        kwargs = dict(causal)
        if k.shape[1] != q.shape[1]:
            if native_gqa:
                kwargs["enable_gqa"] = True
            else:
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if takes_scale:
            kwargs["scale"] = scale
        elif scale is not None and abs(scale * q.shape[-1] ** 0.5 - 1) > 1e-6:
            raise ValueError(f"attention scale {scale} is not 1/sqrt(head_dim), and this torch's varlen_attn takes "
                             "no scale")
        return varlen_attn(q, k, v, cu, cu, max_length, max_length, **kwargs)

    return "torch.nn.attention.varlen.varlen_attn", torch_varlen


def packed_attention_path(device: torch.device) -> str:
    """What a pack's attention runs on `device` (for logs and bench records)."""
    kernel = varlen_kernel() if device.type == "cuda" else None
    return kernel[0] if kernel else "sdpa with a block-diagonal causal mask"


def _varlen(query, key, value, cu_seqlens, max_length, scaling):
    """Causal attention within each sequence of a pack: query [1, H, N, D], key/value [1, H_kv, N, D]
    -> [1, N, H, D]."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [N, heads, D]
    return varlen_kernel()[1](q, k, v, cu_seqlens, max_length, scaling).unsqueeze(0), None


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, fastrlhf_planned=False,
              fastrlhf_mask=None, fastrlhf_block_mask=None, cu_seq_lens_q=None, max_length_q=None, fastrlhf_own=None,
              **kwargs):
    """transformers' attention-function interface (query [B, H, T, D] -> ([B, T, H, D], weights)):
    a planned forward runs its plan (module docstring); any other runs the model's own
    implementation `fastrlhf_own` with transformers' mask."""
    if not fastrlhf_planned:
        own = ALL_ATTENTION_FUNCTIONS[fastrlhf_own]
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                   cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, **kwargs)
    if fastrlhf_block_mask is not None:
        return flex_attention_forward(module, query, key, value, fastrlhf_block_mask, scaling=scaling, dropout=dropout)
    if cu_seq_lens_q is not None and fastrlhf_mask is None:
        return _varlen(query, key, value, cu_seq_lens_q, max_length_q, scaling)
    return sdpa_attention_forward(module, query, key, value, fastrlhf_mask, dropout=dropout, scaling=scaling)


def install(model) -> None:
    """Give `model` (a transformers model, or a peft model around one) the implementation
    `fastrlhf-<its own>`: planned forwards run `attention`'s plan, the others its own implementation
    (with that implementation's mask function). Idempotent."""
    config = model.config
    own = config._attn_implementation
    if own.startswith(PREFIX):
        return
    name = PREFIX + own
    AttentionInterface.register(name, functools.partial(attention, fastrlhf_own=own))
    if own in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[own])
    config._attn_implementation = name


def planned_inputs(config, input_ids: torch.Tensor, plan: dict) -> dict:
    """The keyword arguments of a planned forward of a model `install`ed with this attention: a 4-D
    placeholder mask (transformers then builds none) and the plan."""
    if not config._attn_implementation.startswith(PREFIX):
        raise ValueError(f"a planned attention needs fastrlhf.train.attention.install on the model first (its "
                         f"attention is {config._attn_implementation!r})")
    placeholder = input_ids.new_empty((1, 1, 1, 1), dtype=torch.bool)
    return {"attention_mask": placeholder, "fastrlhf_planned": True, **plan}


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, T, T] bool: key j is seen by query i when j <= i and key j is a real token (transformers'
    causal & padding mask)."""
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def block_causal_mask(sequence: torch.Tensor) -> torch.Tensor:
    """[1, 1, N, N] bool of a pack whose token i belongs to sequence[i]: causal within each sequence."""
    N = sequence.shape[0]
    causal = torch.ones(N, N, dtype=torch.bool, device=sequence.device).tril()
    return (causal & (sequence[:, None] == sequence[None, :]))[None, None]


def shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """[1, 1, N, N] bool of a shared-prompt pack whose token i is in unit segments[0, i] as member
    segments[1, i] (0: the prompt): key j is seen by query i when j <= i, both are in one unit, and j
    is in the prompt or in i's own response."""
    unit, member = segments
    N = unit.shape[0]
    causal = torch.ones(N, N, dtype=torch.bool, device=unit.device).tril()
    same_unit = unit[:, None] == unit[None, :]
    seen = (member[None, :] == 0) | (member[:, None] == member[None, :])
    return (causal & same_unit & seen)[None, None]


def shared_prompt_block_mask(segments: torch.Tensor):
    """flex attention's BlockMask of `shared_prompt_mask`, built block by block on the device (compiled:
    the [N, N] mask is never materialised)."""
    from torch.nn.attention.flex_attention import create_block_mask

    unit, member = segments

    def mask_mod(b, h, q, k):
        return (k <= q) & (unit[q] == unit[k]) & ((member[k] == 0) | (member[k] == member[q]))

    N = unit.shape[0]
    return create_block_mask(mask_mod, None, None, N, N, device=unit.device, _compile=unit.is_cuda)


def shared_prompt_plan(segments: torch.Tensor) -> dict:
    """The attention plan of a shared-prompt pack: its BlockMask on CUDA (flex attention), its 4-D mask
    elsewhere (SDPA)."""
    if segments.is_cuda:
        return {"fastrlhf_block_mask": shared_prompt_block_mask(segments)}
    return {"fastrlhf_mask": shared_prompt_mask(segments)}
