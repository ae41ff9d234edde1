"""Generation: prompts -> a `Rollout` of sampled responses; log-probs of response tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastrlhf import ops
from fastrlhf.data import IGNORE_INDEX, Batch, left_pad, position_ids_from_mask
from fastrlhf.devices import autocast
from fastrlhf.models import lm_head


class Rollout(NamedTuple):
    """Sampled responses for B prompts.

    batch           Batch: input_ids / attention_mask / position_ids [B, P+R], response_mask [B, R]
                    (1 up to and including the first EOS, 0 after it), prompt_len P
    prompts         list[str] of B prompt texts
    responses       list[str] of B decoded responses (special tokens dropped)
    scores          [B] float32 sequence scores (reward model or rule), on the batch's device
    """

    batch: Batch
    prompts: list[str]
    responses: list[str]
    scores: torch.Tensor | None = None


def response_mask_after_eos(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, R] float: 1 up to and including the first EOS of each row, 0 after it."""
    is_eos = (responses == eos_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before t
    return (eos_before == 0).float()


ROLLOUT_CACHES = ("dynamic", "static")


@torch.no_grad()
def generate(lm, tokenizer, prompt_ids: list[list[int]], prompts: list[str], *, max_new_tokens: int,
             temperature: float, device: torch.device, cache: str = "dynamic") -> Rollout:
    """Sample one response per prompt (KV cache, left-padded prompts, position_ids from the
    attention mask); tokens after the first EOS are replaced by padding and masked out.
    cache: `dynamic` or `static` (PPOConfig.rollout_cache)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if cache not in ROLLOUT_CACHES:
        raise ValueError(f"cache must be one of {', '.join(ROLLOUT_CACHES)}, got {cache!r}")
    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    was_training = lm.training
    lm.eval()
    with autocast(device):
        out = lm.generate(
            input_ids=input_ids, attention_mask=attention_mask,  # position_ids = cumsum(mask) - 1, made by HF
            do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
            use_cache=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            **({"cache_implementation": "static"} if cache == "static" else {}),
        )
    lm.train(was_training)
    P = input_ids.shape[1]
    responses = out[:, P:]
    response_mask = response_mask_after_eos(responses, tokenizer.eos_token_id)
    responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
    full_mask = torch.cat([attention_mask, response_mask.long()], dim=1)
    batch = Batch(torch.cat([input_ids, responses], dim=1), full_mask, position_ids_from_mask(full_mask),
                  response_mask, P)
    texts = tokenizer.batch_decode(responses.tolist(), skip_special_tokens=True)
    return Rollout(batch, list(prompts), texts)


def token_logprobs(lm, batch: Batch, hidden: torch.Tensor, *, temperature: float = 1.0,
                   head=None, return_entropy: bool = False):
    """Log-probs [B, R] of the response tokens from hidden states [B, P+R, H], via
    `fastrlhf.ops.linear_logprobs` (never the full [B, R, V] logits). Masked tokens give 0."""
    head = lm_head(lm) if head is None else head
    P = batch.prompt_len
    h = hidden[:, P - 1:-1]
    return ops.linear_logprobs(h, head.weight.to(h.dtype), batch.labels, bias=head.bias, temperature=temperature,
                               return_entropy=return_entropy, ignore_index=IGNORE_INDEX)
