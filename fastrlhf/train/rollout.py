"""Generation: prompts -> a `Rollout` of sampled responses; log-probs of response tokens.

Sampling draws from softmax(logits / temperature), the distribution `token_logprobs` scores,
and nothing else. Two samplers (`--rollout_engine`, `choose_engine`):
- `hf` (the reference and fallback): `generate` samples with transformers' `generate` and a complete
  GenerationConfig of its own (`sampling_config`); the model's `generation_config.json`
  (repetition_penalty, min_new_tokens, no_repeat_ngram_size, suppress_tokens, bad_words_ids, top_k,
  top_p, min_p, ...) takes no part, as TRL's GRPO trainer builds its own. Processors asked for there
  are named once in the log. Its token draw (`--rollout_sampler`, `ROLLOUT_SAMPLERS`): `multinomial`
  (transformers' `torch.multinomial`) or `inverse_cdf` (`InverseCDF`: the same distribution from one
  random number per row instead of one per vocabulary entry, another random stream; it reports the
  log-prob of each token it draws, `Rollout.sampler_logp`).
- `graph`: fastrlhf's own decode engine (fastrlhf.train.engine: merged-LoRA rollout weights, its own KV
  cache, sampling inside one compiled, CUDA-graph captured step); `engine_generate`. Its rollouts
  also carry the sampler's log-probs (`Rollout.sampler_logp`; `sampler_gap` measures them against
  the trainer's).
"""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import torch

from fastrlhf import ops
from fastrlhf.constants import IGNORE_INDEX
from fastrlhf.train import distributed
from fastrlhf.train.data import Batch, left_pad, position_ids_from_mask
from fastrlhf.train.devices import autocast
from fastrlhf.train.engine import draw_by_inversion
from fastrlhf.train.models import lm_head, unwrap

log = logging.getLogger("fastrlhf")


class Rollout(NamedTuple):
    """Sampled responses for B prompts.

    batch           Batch: input_ids / attention_mask / position_ids [B, P+R], response_mask [B, R]
                    (1 up to and including the first EOS, 0 after it), prompt_len P
    prompts         list[str] of B prompt texts
    responses       list[str] of B decoded responses (special tokens dropped)
    scores          [B] float32 sequence scores (reward model or rule), on the batch's device
    sampler_logp    [B, R] float32 log-probs of the response tokens under the sampler itself (the
                    graph engine's merged weights, or generate's logits with --rollout_sampler
                    inverse_cdf), 0 where response_mask is 0; None (hf path with torch.multinomial)
    sampler_values  [B, R] float32 values of a critic's head on the sampler's trunk (the graph engine
                    given one), 0 where response_mask is 0; else None
    """

    batch: Batch
    prompts: list[str]
    responses: list[str]
    scores: torch.Tensor | None = None
    sampler_logp: torch.Tensor | None = None
    sampler_values: torch.Tensor | None = None


def response_mask_after_eos(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, R] float: 1 up to and including the first EOS of each row, 0 after it."""
    is_eos = (responses == eos_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before t
    return (eos_before == 0).float()


ROLLOUT_CACHES = ("dynamic", "static")
ROLLOUT_SAMPLERS = ("multinomial", "inverse_cdf")
# GenerationConfig fields that change the sampled distribution, at the value that leaves it
# softmax(logits / temperature) (None: the processor is off)
NEUTRAL_SAMPLING = {
    "top_k": 0, "top_p": 1.0, "min_p": None, "top_h": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None, "bad_words_ids": None,
    "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": None,
    "num_beams": 1, "watermarking_config": None,
}
_NOTED: set[str] = set()  # what `generate` has said about a model's own generation_config


def sampling_config(tokenizer, *, temperature: float, max_new_tokens: int, cache: str = "dynamic",
                    sampler: str = "multinomial"):
    """The complete GenerationConfig a rollout samples with: softmax(logits / temperature), one
    sample per prompt, the tokenizer's EOS and pad, every other processor at its neutral value.
    sampler `inverse_cdf`: transformers' greedy pick over the scores of `InverseCDF`, which
    generate is then given as its one logits processor (`token_sampler`); the sampling-only fields
    (temperature, top_k, ...) take no part in a greedy pick and stay unset or neutral."""
    from transformers import GenerationConfig

    picked = sampler == "inverse_cdf"
    return GenerationConfig(
        do_sample=not picked, temperature=None if picked else temperature, max_new_tokens=max_new_tokens,
        num_return_sequences=1, use_cache=True, cache_implementation="static" if cache == "static" else None,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, **dict(NEUTRAL_SAMPLING, **({"top_k": None} if picked else {})))


class InverseCDF:
    """A logits processor whose argmax is a draw from softmax(scores / temperature) by inversion: one
    uniform U per row, scaled to the float64 running sum of the float32 exp(scores / temperature - max);
    the token is the first whose running sum exceeds it, so token i with probability p_i (to float64
    rounding), and one of probability 0 (it adds nothing to the sum) never. U is kept below the total,
    so the last token with p > 0 is as far as it goes. One random number per row instead of one per
    vocabulary entry: on one CPU thread ~11 ms per [64, 32000] draw against ~29 ms for the exponential
    race over uniforms (argmax of p / -log U) and ~44 ms for torch.multinomial, whose exponential_ is
    most of it. Each call also keeps the sampler's log-prob of every row's token, scores / temperature
    - max - log(total), in `logps` (one [B] float32 tensor per generated token; `sampler_logprobs`)."""

    def __init__(self, temperature: float):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.logps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        x = scores.float() if self.temperature == 1.0 else scores.float() / self.temperature
        pick, logp = draw_by_inversion(x, torch.rand((x.shape[0], 1), dtype=torch.float64, device=x.device))
        # as torch.multinomial refuses them (on CUDA without a host sync: the assert is the kernel's); a NaN
        # or +inf logit makes the row's log-prob NaN
        torch._assert_async(torch.isfinite(logp).all(),
                            "rollout: a row's logits are not finite (NaN or inf): no token can be drawn from them")
        self.logps.append(logp.squeeze(-1))
        return torch.full_like(x, float("-inf")).scatter_(-1, pick, 0.0)

    def sampler_logprobs(self, new_tokens: int) -> torch.Tensor:
        """[B, new_tokens] float32: the log-probs of the tokens drawn in this generate call, in order."""
        if len(self.logps) != new_tokens:
            raise RuntimeError(f"rollout: generate drew {new_tokens} tokens per row but called the sampler "
                               f"{len(self.logps)} times")
        return torch.stack(self.logps, dim=1)


def token_sampler(sampler: str, temperature: float):
    """The logits processors `generate` passes for `sampler` (ROLLOUT_SAMPLERS)."""
    from transformers import LogitsProcessorList

    if sampler not in ROLLOUT_SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(ROLLOUT_SAMPLERS)}, got {sampler!r}")
    return LogitsProcessorList([InverseCDF(temperature)] if sampler == "inverse_cdf" else [])


def _note_ignored(own) -> None:
    """Log once per setting which sampling processors the model's own generation_config asks for."""
    asked = {k: getattr(own, k, None) for k in NEUTRAL_SAMPLING}
    asked = {k: v for k, v in asked.items() if v is not None and v != NEUTRAL_SAMPLING[k]}
    said = ", ".join(f"{k}={v!r}" for k, v in asked.items())
    if said and said not in _NOTED:
        _NOTED.add(said)
        log.info("rollout: the model's generation_config asks for %s; ignored: PPO's log-probs, ratios and KL are "
                 "those of softmax(logits / temperature), so responses are sampled from exactly that", said)


@contextlib.contextmanager
def _own_generation_config(lm, config):
    """`lm` generates with `config` alone: transformers fills a passed config's unset (None)
    fields from the model's generation_config, so that is `config` too for the call."""
    base = unwrap(lm)
    own = base.generation_config
    _note_ignored(own)
    base.generation_config = config
    try:
        yield
    finally:
        base.generation_config = own


@torch.no_grad()
def generate(lm, tokenizer, prompt_ids: list[list[int]], prompts: list[str], *, max_new_tokens: int,
             temperature: float, device: torch.device, cache: str = "dynamic",
             sampler: str = "multinomial") -> Rollout:
    """Sample one response per prompt (KV cache, left-padded prompts, position_ids from the
    attention mask) from softmax(logits / temperature) alone (`sampling_config`; the model's own
    generation_config is ignored); tokens after the first EOS are replaced by padding and masked out.
    cache: `dynamic` or `static` (PPOConfig.rollout_cache); sampler: `multinomial` or `inverse_cdf`
    (PPOConfig.rollout_sampler; the same distribution, another random stream; the Rollout then carries
    the sampler's log-probs of its tokens)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if cache not in ROLLOUT_CACHES:
        raise ValueError(f"cache must be one of {', '.join(ROLLOUT_CACHES)}, got {cache!r}")
    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    processors = token_sampler(sampler, temperature)
    config = sampling_config(tokenizer, temperature=temperature, max_new_tokens=max_new_tokens, cache=cache,
                             sampler=sampler)
    was_training = lm.training
    lm.eval()
    with autocast(device), _own_generation_config(lm, config):
        # position_ids = cumsum(mask) - 1, made by HF
        out = lm.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                          logits_processor=processors)
    lm.train(was_training)
    responses = out[:, input_ids.shape[1]:]
    logps = processors[0].sampler_logprobs(responses.shape[1]) if processors else None
    return _rollout(input_ids, attention_mask, responses, tokenizer, prompts, sampler_logp=logps)


def _rollout(input_ids, attention_mask, responses, tokenizer, prompts, sampler_logp=None,
             sampler_values=None, lengths=None) -> Rollout:
    """The Rollout of left-padded prompts [B, P] and sampled tokens [B, R']: tokens after the first EOS
    (or past `lengths` [B], where the sampler ended rows at their own limits) become padding and are
    masked out; columns past the longest response are dropped."""
    response_mask = response_mask_after_eos(responses, tokenizer.eos_token_id)
    if lengths is not None:
        response_mask = response_mask * (torch.arange(responses.shape[1], device=responses.device) < lengths[:, None])
    R = max(1, int(response_mask.sum(-1).max()))
    response_mask, responses = response_mask[:, :R], responses[:, :R]
    responses = torch.where(response_mask.bool(), responses, tokenizer.pad_token_id)
    full_mask = torch.cat([attention_mask, response_mask.long()], dim=1)
    batch = Batch(torch.cat([input_ids, responses], dim=1), full_mask, position_ids_from_mask(full_mask),
                  response_mask, input_ids.shape[1])
    texts = tokenizer.batch_decode(responses.tolist(), skip_special_tokens=True)
    sampler_logp, sampler_values = (None if x is None else x[:, :R] * response_mask
                                    for x in (sampler_logp, sampler_values))
    return Rollout(batch, list(prompts), texts, sampler_logp=sampler_logp, sampler_values=sampler_values)


# ---------------------------------------------------------------- the graph engine

ROLLOUT_ENGINES = ("hf", "graph", "auto")


def choose_engine(name: str, lm, device: torch.device) -> tuple[str, str]:
    """(`hf` or `graph`, why) for `--rollout_engine name`: `auto` is graph on CUDA where the engine
    supports the model, else hf; `graph` falls back to hf (with the reason) where it does not."""
    from fastrlhf.train.engine import unsupported_reason

    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {name!r}")
    if name == "hf":
        return "hf", "--rollout_engine hf"
    if getattr(unwrap(lm), "is_loaded_in_4bit", False):  # declined: the copy would outweigh the 4-bit base ~4x
        return "hf", (f"--rollout_engine {name}, but the base is 4-bit (--qlora): the graph engine's merged bf16 copy "
                      "would hold 2 bytes per base weight beside NF4's ~0.52, the memory QLoRA saves; the hf path "
                      "samples from the 4-bit model")
    reason = unsupported_reason(lm)
    if reason is not None:
        return "hf", f"--rollout_engine {name}, but the graph engine cannot run this model: {reason}"
    if name == "auto" and device.type != "cuda":
        return "hf", f"--rollout_engine auto on {device.type}: the graph engine's gain is CUDA graphs"
    how = "compiled step captured as a CUDA graph" if device.type == "cuda" else \
        f"the same step function run eagerly on {device.type} (no CUDA graph)"
    return "graph", f"--rollout_engine {name}: fastrlhf's decode engine, {how}"


def make_engine(name: str, lm, tokenizer, *, batch: int, prompt_len: int, new_tokens: int, temperature: float,
                device: torch.device, sampler: str = "multinomial", slots: int = 0, keep_memory: bool = False):
    """The decode engine `--rollout_engine name` asks for, or None for the hf path; the choice and
    its reason are logged. Under torchrun each rank builds its own for its share of the rows. `sampler`
    (--rollout_sampler): `inverse_cdf` draws by inversion in the step, else by the exponential race.
    `slots` (--rollout_slots): the sequences decoded at once, 0 = all `batch`. `keep_memory`
    (--rollout_keep_memory): keep the engine's KV pool and weight copy between rollouts, else free them
    after each (DecodeEngine.release)."""
    from fastrlhf.train.engine import DecodeEngine

    engine, why = choose_engine(name, lm, device)
    log.info("rollout: engine %s (%s)", engine, why)
    if engine == "hf":
        return None
    cuda = device.type == "cuda"
    # a sharded policy's gathered tensors are freed after each rollout: the engine keeps copies
    return DecodeEngine(lm, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, temperature=temperature,
                        eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, device=device, compile=cuda,
                        cuda_graph=cuda, share_frozen=not distributed.active(), inverse_cdf=sampler == "inverse_cdf",
                        slots=slots or batch, keep_memory=keep_memory)


def engine_generate(engine, lm, tokenizer, prompt_ids: list[list[int]], prompts: list[str],
                    value_head=None, limits: list[int] | None = None) -> Rollout:
    """`generate`'s Rollout, sampled by the decode engine from the current weights of `lm` (re-formed
    in place first: the rollout follows the last optimizer step), with the sampler's log-probs, and
    the values of `value_head` (a critic's head on `lm`'s trunk) where one is given."""
    input_ids, attention_mask, responses, logps, values = engine.generate(lm, prompt_ids, value_head, limits)
    return _rollout(input_ids, attention_mask, responses, tokenizer, prompts, sampler_logp=logps,
                    sampler_values=values, lengths=None if limits is None else engine.ends)


def sampler_gap(sampler_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max over the response tokens of every rank of |logp_sampler - old_logp|: how far the
    distribution the engine sampled from (merged bf16 weights) is from the one the trainer scores."""
    gap = (sampler_logp - old_logp).abs() * mask
    total = distributed.all_sum(torch.stack([gap.sum(), mask.sum()]))
    top, _ = distributed.max_and_mean({"gap": gap.max().item()})
    return {"rollout/logp_gap_mean": (total[0] / total[1].clamp(min=1)).item(), "rollout/logp_gap_max": top["gap"]}


def token_logprobs(lm, batch: Batch, hidden: torch.Tensor, *, temperature: float = 1.0,
                   head=None, return_entropy: bool = False):
    """Log-probs [B, R] of the response tokens from hidden states [B, P+R, H], via
    `fastrlhf.ops.linear_logprobs` (never the full [B, R, V] logits). Masked tokens give 0."""
    head = lm_head(lm) if head is None else head
    P = batch.prompt_len
    h = hidden[:, P - 1:-1]
    return ops.linear_logprobs(h, head.weight.to(h.dtype), batch.labels, bias=head.bias, temperature=temperature,
                               return_entropy=return_entropy, ignore_index=IGNORE_INDEX)
