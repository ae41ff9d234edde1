"""Who is measured: one callable per (op, provider, pass).

    fastrlhf               the public ops (`fastrlhf.ops.<name>`): Triton on CUDA, the torch path
                           on CPU; a row's `backend` says which
    fastrlhf-accum-weight  the linear ops with d(weight) accumulated in the weight's own dtype
    torch                  `fastrlhf.reference` eager, in the input dtype, as a user would write it
                           (for GAE: the Python loop over T)
    torch.compile          the same under `torch.compile`
    verl, openrlhf, trl, liger
                           the peers' own functions, when importable (skipped with the reason
                           otherwise; liger needs CUDA)
    torch (decode_attention)  SDPA with enable_gqa over each row's written slots
    flex, flash_attn       decode_attention's peers: compiled flex attention and flash-attn's
                           `flash_attn_with_kvcache` (CUDA; flash_attn where installed)
    matmuls                the bare matmuls of a linear pass (the bound the linear ops are held to)
    trl (linear_distill_loss)  TRL's `_chunked_divergence_loss` (DistillationTrainer's chunked kernel)

A provider callable takes the case's inputs as keyword arguments; `load_provider` returns
it with a flag saying whether it runs under autograd (only `matmuls` does not).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable

import torch

from fastrlhf import ops, reference

PEERS = ("verl", "openrlhf", "trl", "liger", "flex", "flash_attn")
WEIGHT_ACCUM = "fastrlhf-accum-weight"
# issue 24: policy-loss modes of ppo_actor_loss timed beside the vanilla one ("fastrlhf"), as providers
MODES_TIMED = ("gspo", "cispo", "clip_cov")
MODE_PROVIDERS = {m: f"fastrlhf-{m}" for m in MODES_TIMED}
PROVIDERS = ("fastrlhf", WEIGHT_ACCUM, *MODE_PROVIDERS.values(), "torch", "torch.compile", *PEERS, "matmuls")
SLOW_PROVIDERS = ("flex", "torch.compile")  # measured after every other provider of every case (compile time)
ACTOR_KW = {"kl_coef": 0.05, "entropy_coef": 0.01}
DISTILL_KW = {"beta": 0.5}
DISTILL_REF_MAX_LOGITS = 2**28  # N x V above which the materialised distillation reference is not run


class Skip(Exception):
    """A provider that cannot run this case; the message says why."""


def first(out):
    """The loss of (loss, stats), the logp of (logp, entropy), else the output itself."""
    return out[0] if isinstance(out, tuple | list) else out


# ---------------------------------------------------------------- ours and the reference


def _ours(name, **kw):
    """fastrlhf.ops.<name> with the case's keyword arguments."""

    def load(pass_):
        fn = getattr(ops, name)
        return lambda **inputs: fn(**inputs, **kw)

    return load


def _ours_weight_accum(name, **kw):
    """fastrlhf.ops.<name> with `accum_dtype=weight.dtype`: no fp32 V x H buffer."""

    def load(pass_):
        fn = getattr(ops, name)
        return lambda **inputs: fn(**inputs, accum_dtype=inputs["weight"].dtype, **kw)

    return load


def _ref(name, **kw):
    def load(pass_):
        fn = getattr(reference, name)
        return lambda **inputs: fn(**inputs, **kw)

    return load


def _linear_actor_ref(**kw):
    """The materialised-logits actor loss: logits = hidden W^T, then reference.ppo_actor_loss."""

    def load(pass_):
        def run(hidden, weight, labels, **rest):
            return reference.ppo_actor_loss(hidden @ weight.T, labels, **rest, **kw)

        return run

    return load


def _matmuls(pass_):
    """The bare matmuls of a linear log-prob pass: logits = h W^T forward; d(h) = g W and
    d(W) = g^T h backward (g stands in for d(logits), same shape)."""

    @torch.no_grad()
    def run(hidden, weight, labels, **_):
        h = hidden.reshape(-1, hidden.shape[-1])
        g = h @ weight.T
        if pass_ != "fwd":
            g @ weight
            g.T @ h

    return run


_matmuls.autograd = False
_matmuls.passes = ("fwd", "fwd+bwd")  # bwd alone would need d(logits) made outside the timing


def _distill_matmuls(pass_):
    """The four matmuls distillation from hidden states needs: both models' logits forward; d(h) = g W and
    d(W) = g^T h of the student backward (g stands in for d(student logits), same shape)."""

    @torch.no_grad()
    def run(student_hidden, student_weight, teacher_hidden, teacher_weight, **_):
        g = student_hidden @ student_weight.T
        teacher_hidden @ teacher_weight.T
        if pass_ != "fwd":
            g @ student_weight
            g.T @ student_hidden

    return run


_distill_matmuls.autograd = False


def _distill_ours(accum=False):
    """fastrlhf.ops.linear_distill_loss; with `accum`, d(weight) accumulated in the weight's dtype."""

    def load(pass_):
        def run(**inputs):
            kw = {"accum_dtype": inputs["student_weight"].dtype} if accum else {}
            return ops.linear_distill_loss(**inputs, **DISTILL_KW, **kw)

        return run

    return load


def _distill_ref(pass_):
    """The materialised version: both models' logits, then reference.distill_loss."""

    def run(student_hidden, student_weight, teacher_hidden, teacher_weight, mask):
        if student_hidden.shape[0] * student_weight.shape[0] > DISTILL_REF_MAX_LOGITS:
            raise Skip(f"the materialised reference at N x V = {student_hidden.shape[0] * student_weight.shape[0]:.3g} "
                       "holds both models' logits and several same-size temporaries")
        return reference.linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, mask,
                                             **DISTILL_KW)

    return run


def _decode_ours(pass_):
    """fastrlhf.ops.decode_attention on the case's cache, and its shared prompt where G > 1."""

    def run(q, k_cache, v_cache, lengths, k_prefix=None, v_prefix=None, prefix_lengths=None, **_):
        prefix = None if k_prefix is None else (k_prefix, v_prefix, prefix_lengths, q.shape[0] // k_prefix.shape[0])
        return ops.decode_attention(q, k_cache, v_cache, lengths, scale=q.shape[-1] ** -0.5, prefix=prefix)

    return run


def _decode_sdpa(pass_):
    """SDPA over each row's written slots (the same t for every row of a case), its GQA without repeat_kv."""
    import torch.nn.functional as F

    def run(q, k_written, v_written, **_):
        return F.scaled_dot_product_attention(q, k_written, v_written, scale=q.shape[-1] ** -0.5, enable_gqa=True)

    return run


# ---------------------------------------------------------------- peers


def _peer(module: str, build: Callable, *, cuda_only=False):
    """Import `module`, then `build(module, pass_)` returns the callable."""

    def load(pass_):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise Skip(f"{module} not importable ({exc.__class__.__name__}: {exc})") from None
        return build(mod, pass_)

    load.cuda_only = cuda_only
    return load


def _param(fn, name) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _verl_logprobs(mod, pass_):
    return lambda logits, labels: mod.logprobs_from_logits(logits, labels)


def _openrlhf_logprobs(mod, pass_):
    return lambda logits, labels: mod.log_probs_from_logits(logits, labels)


def _trl_logprobs(mod, pass_):
    return lambda logits, labels: mod.selective_log_softmax(logits, labels)


def _liger_logprobs(mod, pass_):
    # Liger's cross entropy returns -logp per token (reduction="none"); with grad enabled its
    # forward also writes d(logits) into the logits' storage (why every provider gets fresh inputs)
    def run(logits, labels):
        V = logits.shape[-1]
        nll = mod.liger_cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
        return -nll.view(labels.shape)

    return run


def _liger_linear_logprobs(mod, pass_):
    def run(hidden, weight, labels):
        nll = mod.liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
        return -nll.view(labels.shape)

    return run


def _trl_distill(mod, pass_):
    def run(student_hidden, student_weight, teacher_hidden, teacher_weight, mask):
        return mod._chunked_divergence_loss(student_hidden, teacher_hidden, student_weight, teacher_weight, mask,
                                            DISTILL_KW["beta"])

    return run


def _liger_distill(mod, pass_):
    def run(student_hidden, student_weight, teacher_hidden, teacher_weight, mask):
        return mod.LigerFusedLinearJSDFunction.apply(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                                     None, DISTILL_KW["beta"])

    return run


def _verl_kl(mod, pass_):
    return lambda logp, ref_logp: mod.kl_penalty(logp, ref_logp, "low_var_kl")


def _openrlhf_kl(mod, pass_):
    fn = mod.compute_approx_kl
    if _param(fn, "kl_estimator"):
        return lambda logp, ref_logp: fn(logp, ref_logp, kl_estimator="k3")
    if _param(fn, "use_kl_estimator_k3"):
        return lambda logp, ref_logp: fn(logp, ref_logp, use_kl_estimator_k3=True)
    raise Skip("openrlhf compute_approx_kl has no k3 option in this version")


def _verl_gae(mod, pass_):
    # verl's response_mask is numeric (its trainer's attention-mask slice): it computes 1 - mask, which a
    # bool tensor refuses; the cast is one elementwise op next to its loop of T steps
    return lambda rewards, values, mask: mod.compute_gae_advantage_return(rewards, values, mask.to(values.dtype),
                                                                          1.0, 0.95)


def _verl_policy_loss(mod, pass_):
    if not hasattr(mod, "compute_policy_loss"):
        raise Skip("verl core_algos has no compute_policy_loss in this version")
    fn = mod.compute_policy_loss
    return lambda logp, old_logp, advantages, mask: first(fn(old_logp, logp, advantages, mask, 0.2))


def _openrlhf_policy_loss(mod, pass_):
    loss = mod.PolicyLoss()
    return lambda logp, old_logp, advantages, mask: first(loss(logp, old_logp, advantages, mask))


def _verl_value_loss(mod, pass_):
    fn = mod.compute_value_loss
    return lambda values, old_values, returns, mask: first(fn(values, returns, old_values, mask, 0.2))


def _openrlhf_value_loss(mod, pass_):
    loss = mod.ValueLoss(clip_eps=0.2) if _param(mod.ValueLoss, "clip_eps") else mod.ValueLoss()
    return lambda values, old_values, returns, mask: first(loss(values, old_values, returns, mask))


def _flex_decode(mod, pass_):
    compiled = torch.compile(mod.flex_attention, dynamic=False)

    def run(q, k_written, v_written, **_):
        return compiled(q, k_written, v_written, scale=q.shape[-1] ** -0.5, enable_gqa=True)

    return run


def _flash_decode(mod, pass_):
    """flash_attn_with_kvcache on the written slots seen in its [B, T, H, D] layout (views, no copy)."""

    def run(q, k_written, v_written, written, **_):
        return mod.flash_attn_with_kvcache(q.transpose(1, 2), k_written.transpose(1, 2), v_written.transpose(1, 2),
                                           cache_seqlens=written, softmax_scale=q.shape[-1] ** -0.5, causal=True)

    return run


_VERL_ALGOS, _VERL_F = "verl.trainer.ppo.core_algos", "verl.utils.torch_functional"
_ORLHF_UTILS, _ORLHF_LOSS = "openrlhf.models.utils", "openrlhf.models.loss"
_LIGER_F = "liger_kernel.transformers.functional"

# op -> provider -> loader(pass_) -> callable(**inputs); torch.compile wraps the "torch" entry
TABLE: dict[str, dict[str, Callable]] = {
    "logprobs": {"fastrlhf": _ours("logprobs"), "torch": _ref("logprobs"),
                 "verl": _peer(_VERL_F, _verl_logprobs), "openrlhf": _peer(_ORLHF_UTILS, _openrlhf_logprobs),
                 "trl": _peer("trl.trainer.utils", _trl_logprobs),
                 "liger": _peer(_LIGER_F, _liger_logprobs, cuda_only=True)},
    "ppo_actor_loss": {"fastrlhf": _ours("ppo_actor_loss", **ACTOR_KW),
                       **{p: _ours("ppo_actor_loss", loss_mode=m, **ACTOR_KW) for m, p in MODE_PROVIDERS.items()},
                       "torch": _ref("ppo_actor_loss", **ACTOR_KW)},
    "linear_logprobs": {"fastrlhf": _ours("linear_logprobs"), WEIGHT_ACCUM: _ours_weight_accum("linear_logprobs"),
                        "torch": _ref("linear_logprobs"),
                        "liger": _peer(_LIGER_F, _liger_linear_logprobs, cuda_only=True), "matmuls": _matmuls},
    "linear_ppo_actor_loss": {"fastrlhf": _ours("linear_ppo_actor_loss", **ACTOR_KW),
                              WEIGHT_ACCUM: _ours_weight_accum("linear_ppo_actor_loss", **ACTOR_KW),
                              "torch": _linear_actor_ref(**ACTOR_KW), "matmuls": _matmuls},
    "linear_distill_loss": {"fastrlhf": _distill_ours(), WEIGHT_ACCUM: _distill_ours(accum=True),
                            "torch": _distill_ref, "trl": _peer("trl.trainer.distillation_trainer", _trl_distill),
                            "liger": _peer("liger_kernel.ops.fused_linear_jsd", _liger_distill, cuda_only=True),
                            "matmuls": _distill_matmuls},
    "token_kl": {"fastrlhf": _ours("token_kl", estimator="k3"), "torch": _ref("token_kl", estimator="k3"),
                 "verl": _peer(_VERL_ALGOS, _verl_kl), "openrlhf": _peer(_ORLHF_UTILS, _openrlhf_kl)},
    "kl_shaped_rewards": {"fastrlhf": _ours("kl_shaped_rewards", kl_coef=0.05),
                          "torch": _ref("kl_shaped_rewards", kl_coef=0.05)},
    "gae": {"fastrlhf": _ours("gae", gamma=1.0, lam=0.95), "torch": _ref("gae", gamma=1.0, lam=0.95),
            "verl": _peer(_VERL_ALGOS, _verl_gae)},
    "policy_loss": {"fastrlhf": _ours("policy_loss"), "torch": _ref("policy_loss"),
                    "verl": _peer(_VERL_ALGOS, _verl_policy_loss),
                    "openrlhf": _peer(_ORLHF_LOSS, _openrlhf_policy_loss)},
    "value_loss": {"fastrlhf": _ours("value_loss"), "torch": _ref("value_loss"),
                   "verl": _peer(_VERL_ALGOS, _verl_value_loss),
                   "openrlhf": _peer(_ORLHF_LOSS, _openrlhf_value_loss)},
    "decode_attention": {"fastrlhf": _decode_ours, "torch": _decode_sdpa,
                         "flex": _peer("torch.nn.attention.flex_attention", _flex_decode, cuda_only=True),
                         "flash_attn": _peer("flash_attn", _flash_decode, cuda_only=True)},
}


def providers_of(op: str) -> list[str]:
    """The providers with an entry for `op`, in PROVIDERS order (torch.compile where torch is)."""
    have = set(TABLE[op]) | ({"torch.compile"} if "torch" in TABLE[op] else set())
    return [p for p in PROVIDERS if p in have]


def passes_of(op: str, provider: str, passes: tuple[str, ...]) -> tuple[str, ...]:
    """The passes of `passes` that `provider` can run for `op` (matmuls: no bwd alone)."""
    allowed = getattr(TABLE[op].get(provider), "passes", passes)
    return tuple(p for p in passes if p in allowed)


def backend_name(device: torch.device) -> str:
    """Which path fastrlhf.ops takes for tensors on `device` (its documented dispatch rule:
    CUDA -> Triton, CPU -> torch, FASTRLHF_BACKEND=triton|torch forces one)."""
    forced = os.environ.get("FASTRLHF_BACKEND", "auto").lower()
    if forced == "triton" or (forced == "auto" and device.type == "cuda"):
        return "triton" if device.type == "cuda" else "triton (interpreter)"
    return "torch"


def load_provider(op: str, provider: str, pass_: str, device: torch.device, *, no_compile: str | None = None
                  ) -> tuple[Callable, bool]:
    """(fn(**inputs), runs under autograd) for one provider and pass; raises Skip with the reason."""
    if provider == "torch.compile":
        if no_compile:
            raise Skip(f"torch.compile not run: {no_compile}")
        eager, _ = load_provider(op, "torch", pass_, device)
        return torch.compile(eager), True
    if provider not in TABLE[op]:
        raise Skip(f"{provider} has no {op}")
    load = TABLE[op][provider]
    if getattr(load, "cuda_only", False) and device.type != "cuda":
        raise Skip(f"{provider} needs CUDA")
    try:
        fn = load(pass_)
    except (ImportError, NotImplementedError, AttributeError) as exc:
        raise Skip(f"{provider}: {exc.__class__.__name__}: {exc}") from None
    return fn, getattr(load, "autograd", True)
