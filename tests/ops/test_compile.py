"""Every Triton kernel launch of representative op calls compiles to cubin for sm_90 and sm_80.

The op tests run the kernels in the interpreter on CPU, which accepts code the compiler
rejects. Here the same public ops run once more (interpreted, or on the GPU where there is
one) while every launch is recorded with triton's own specialisation; each distinct launch is
then compiled ahead of time for Hopper and Ampere by worker processes without the interpreter
(see compile_capture.py). The calls cover each kernel's constexpr variants: dtypes, mode flags,
the small- and large-vocab block sizes, aligned and unaligned strides, bool and float masks, the decode
attention's head shapes and prefix blocks.
"""

import importlib
import json
import pkgutil

import numpy
import pytest
import torch
from compile_capture import compile_all, describe, record_launches
from conftest import DEVICE
from triton.backends import backends as triton_backends

from fastrlhf import kernels, ops

TARGETS = {"sm90": 90, "sm80": 80}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(  # slow: every kernel compiled for two targets
    "nvidia" not in triton_backends,
    reason=f"this triton build has no CUDA backend (backends: {sorted(triton_backends)}), so it cannot "
           "compile for sm_90 / sm_80",
)]


def _kernel_names() -> list[str]:
    """Every launchable kernel in fastrlhf.kernels: the `@triton.jit` objects named `*_kernel`."""
    from triton.runtime.jit import KernelInterface

    names = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"fastrlhf.kernels.{info.name}")
        names += [f"{module.__name__}.{n}" for n, obj in vars(module).items()
                  if isinstance(obj, KernelInterface) and n.endswith("_kernel")]
    return sorted(names)


KERNELS = _kernel_names()


def _autotuned() -> dict[str, list]:
    """{kernel name: its triton.Config list} for every `triton.autotune` wrapper in fastrlhf.kernels.
    The interpreter launches the plain kernel with a fixed config; on CUDA the autotuner may pick
    any of its configs, so each recorded launch of that kernel is also compiled with each config."""
    from triton.runtime.autotuner import Autotuner

    out = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"fastrlhf.kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, Autotuner):
                out[f"{module.__name__}.{obj.base_fn.__qualname__}"] = obj.configs
    return out


def _with_config(spec: dict, config) -> dict:
    """`spec` with the constexprs and launch options of one triton.Config."""
    names = list(spec["signature"])
    spec = json.loads(json.dumps(spec))
    for entry in spec["constexprs"]:
        name = names[entry[0][0]] if len(entry[0]) == 1 else None
        if name in config.kwargs:
            entry[1] = config.kwargs[name]
    missing = set(config.kwargs) - {names[e[0][0]] for e in spec["constexprs"] if len(e[0]) == 1}
    assert not missing, f"{spec['name']}: config sets {missing}, which the recorded launch does not pass"
    spec["options"].update({k: v for k, v in config.all_kwargs().items() if k not in config.kwargs
                            and k != "ir_override" and v is not None})
    return spec


# ---------------------------------------------------------------- representative calls


def _grad(outputs, inputs):
    """Backward with random upstream gradients (the kernels see real values, not ones)."""
    outputs = [o for o in outputs if o.requires_grad]
    torch.autograd.grad(outputs, inputs, [torch.randn_like(o) for o in outputs])


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()


def _mask(B, T, dtype=torch.bool):
    m = torch.rand(B, T, device=DEVICE) > 0.3
    m[:, 0] = True
    return m.to(dtype)


def _logprobs_calls():
    # (dtype, V, temperature, upstream gradients): V = 37 is one small block; V = 5000 takes the
    # 4096-wide block, 8 warps and the vocab loop. "both" / "logp" / "entropy" pick the backward's
    # HAS_GRAD_LOGP / HAS_GRAD_ENTROPY variant.
    for dtype, V, temperature, grads in [(torch.float32, 37, 1.0, ("both", "logp", "entropy")),
                                         (torch.bfloat16, 37, 0.7, ("both",)),
                                         (torch.float16, 5000, 1.0, ("logp",)),
                                         (torch.bfloat16, 5000, 0.7, ("both", "entropy"))]:
        logits = _leaf(2, 5, V, dtype=dtype)
        labels = torch.randint(0, V, (2, 5), device=DEVICE)
        labels[0, 1] = -100  # ignore_index
        for grad in grads:
            if grad == "logp":
                outputs = [ops.logprobs(logits, labels, temperature=temperature)]
            else:
                logp, ent = ops.logprobs(logits, labels, temperature=temperature, return_entropy=True)
                outputs = [logp, ent] if grad == "both" else [ent]
            _grad(outputs, logits)
    # a non-contiguous view (logits[:, :-1]) with an odd vocab: unaligned strides, 2048-wide block
    logits = _leaf(2, 6, 1271, dtype=torch.bfloat16)
    logp = ops.logprobs(logits[:, :-1], torch.randint(0, 1271, (2, 5), device=DEVICE))
    _grad([logp], logits)
    # in-place backward into the storage of a copy of the logits
    x = _leaf(3, 4, 64, dtype=torch.bfloat16)
    logp = ops.logprobs(x.clone(), torch.randint(0, 64, (3, 4), device=DEVICE), inplace_backward=True)
    _grad([logp], x)
    # K labels per position (the backward's ONE_HOT=False variant) and the entropy-only op
    x = _leaf(2, 5, 300, dtype=torch.bfloat16)
    logp, ent = ops.logprobs(x, torch.randint(0, 300, (2, 5, 3), device=DEVICE), return_entropy=True)
    _grad([logp, ent], x)
    _grad([ops.entropy(x, temperature=0.8)], x)
    # few rows (fewer than 4 per SM; the interpreter counts 2 SMs): the vocab split over programs and
    # the combine pass, forward with and without entropy; the split backward
    x = _leaf(1, 3, 2 * 8192 + 40, dtype=torch.bfloat16)
    labels = torch.randint(0, x.shape[-1], (1, 3), device=DEVICE)
    logp, ent = ops.logprobs(x, labels, return_entropy=True)
    _grad([logp, ent], x)
    _grad([ops.logprobs(x, labels, temperature=0.9)], x)


def _linear_logprobs_calls():
    # the chunked path (fastrlhf/ops/linear.py): several chunks, bias, entropy, temperature
    hidden, weight, bias = (_leaf(2, 7, 16, dtype=torch.bfloat16), _leaf(300, 16, dtype=torch.bfloat16),
                            _leaf(300, dtype=torch.bfloat16))
    labels = torch.randint(0, 300, (2, 7), device=DEVICE)
    logp, ent = ops.linear_logprobs(hidden, weight, labels, bias=bias, return_entropy=True, chunk_size=4,
                                    temperature=0.9)
    _grad([logp, ent], (hidden, weight, bias))
    # and the fused actor loss from hidden states, fp32
    hidden, weight = _leaf(2, 7, 16), _leaf(300, 16)
    B_T = (2, 7)
    loss, _ = ops.linear_ppo_actor_loss(
        hidden, weight, torch.randint(0, 300, B_T, device=DEVICE), torch.randn(B_T, device=DEVICE) - 5,
        torch.randn(B_T, device=DEVICE), _mask(*B_T), chunk_size=5, ref_logp=torch.randn(B_T, device=DEVICE) - 5,
        kl_coef=0.1, entropy_coef=0.01)
    _grad([loss], (hidden, weight))


def _kl_calls():
    for estimator in ("k1", "k2", "k3", "abs"):
        for clamp in (None, 5.0):
            logp, ref = _leaf(3, 37), _leaf(3, 37)
            _grad([ops.token_kl(logp, ref, estimator=estimator, clamp=clamp)], (logp, ref))
            scores = torch.randn(3, device=DEVICE)
            ops.kl_shaped_rewards(scores, logp.detach(), ref.detach(), _mask(3, 37), kl_coef=0.05,
                                  estimator=estimator, clamp=clamp)
    # half-precision inputs and a float mask; a row longer than one 1024 block
    logp, ref = _leaf(2, 1100, dtype=torch.bfloat16), _leaf(2, 1100, dtype=torch.bfloat16)
    _grad([ops.token_kl(logp, ref, estimator="k3")], (logp, ref))
    ops.kl_shaped_rewards(torch.randn(2, device=DEVICE), logp.detach(), ref.detach(),
                          _mask(2, 1100, torch.float32), kl_coef=0.05, estimator="k3")


def _gae_calls():
    for mask_mode in ("skip", "zero"):
        for whiten in (True, False):
            for T, mask_dtype in ((37, torch.bool), (64, torch.float32)):
                rewards, values = torch.randn(3, T, device=DEVICE), torch.randn(3, T, device=DEVICE)
                ops.gae(rewards, values, _mask(3, T, mask_dtype), gamma=0.99, lam=0.95, mask_mode=mask_mode,
                        whiten=whiten)
    # bf16 inputs and a row longer than one 1024 block (the block-to-block carry)
    ops.gae(torch.randn(2, 1100, device=DEVICE).bfloat16(), torch.randn(2, 1100, device=DEVICE).bfloat16(),
            _mask(2, 1100), gamma=0.99, lam=0.95)


def _whiten_calls():
    for shift_mean in (True, False):
        for x, mask in ((torch.randn(3, 37, device=DEVICE), _mask(3, 37)),
                        (torch.randn(2, 1100, device=DEVICE).bfloat16(), _mask(2, 1100, torch.float32))):
            ops.whiten(x, mask, unbiased=True, shift_mean=shift_mean)
    ops.whiten(torch.randn(3, 37, device=DEVICE), _mask(3, 37), unbiased=False)


def _loss_calls():
    B, T = 3, 37
    for dual_clip in (None, 3.0):
        for mask in (_mask(B, T), _mask(B, T, torch.float32)):
            logp = _leaf(B, T)
            loss, _ = ops.policy_loss(logp, torch.randn(B, T, device=DEVICE), torch.randn(B, T, device=DEVICE), mask,
                                      clip_high=0.28, dual_clip=dual_clip)
            _grad([loss], logp)
            with torch.no_grad():  # the forward-only variant
                ops.policy_loss(logp, torch.randn(B, T, device=DEVICE), torch.randn(B, T, device=DEVICE), mask,
                                dual_clip=dual_clip)
            # per-token importance weights (HAS_IS_WEIGHTS)
            loss, _ = ops.policy_loss(logp, torch.randn(B, T, device=DEVICE), torch.randn(B, T, device=DEVICE), mask,
                                      dual_clip=dual_clip, is_weights=torch.rand(B, T, device=DEVICE))
            _grad([loss], logp)
    for clip in (None, 0.2):
        for dtype in (torch.float32, torch.bfloat16):
            values = _leaf(B, T, dtype=dtype)
            old, ret = torch.randn(B, T, device=DEVICE).to(dtype), torch.randn(B, T, device=DEVICE).to(dtype)
            loss, _ = ops.value_loss(values, old, ret, _mask(B, T), clip=clip, agg="seq-mean-token-mean")
            _grad([loss], values)
            with torch.no_grad():
                ops.value_loss(values, old, ret, _mask(B, T), clip=clip)
    _actor_loss_calls()


def _actor_loss_calls():
    """The fused actor loss from logits (kernels/ppo_loss.py): its gradient flags, forward only, and the
    in-place scale of its backward (its CUDA configs: the autotune expansion in `launches`)."""
    B, T = 3, 7

    def call(V, dtype, grad=True, ref=True, **kw):
        logits = _leaf(B, T, V, dtype=dtype)
        with torch.set_grad_enabled(grad):
            loss, _ = ops.ppo_actor_loss(
                logits, torch.randint(0, V, (B, T), device=DEVICE), torch.randn(B, T, device=DEVICE) - 4,
                torch.randn(B, T, device=DEVICE), _mask(B, T), ref_logp=torch.randn(B, T, device=DEVICE) - 4 if ref
                else None, **kw)
        if grad:
            _grad([loss], logits)

    call(50, torch.bfloat16, kl_coef=0.1, entropy_coef=0.01)
    call(50, torch.bfloat16, grad=False, kl_coef=0.1, entropy_coef=0.01)  # NEED_GRAD=False
    call(300, torch.float32, kl_coef=0.1, kl_estimator="abs", kl_clamp=5.0, dual_clip=3.0, temperature=0.7,
         is_weights=torch.rand(B, T, device=DEVICE), agg="seq-mean-token-mean")
    call(300, torch.float16, kl_coef=0.2, kl_estimator="k2", kl_straight_through=True)  # no entropy term
    call(37, torch.float32, ref=False, entropy_coef=0.01, clip_high=0.28)  # no KL term


def _distill_calls():
    """kernels/distill.py: each divergence (MODE 0 forward KL, 1 reverse KL, 2 JSD), with and without the
    gradient, softcaps, half and full precision, a small V (one tile, 4 warps) and a vocab loop, views."""
    for beta, dtype, V, kw in [(0.0, torch.bfloat16, 37, {}),
                               (1.0, torch.float32, 5000, dict(temperature=0.7, student_softcap=3.0)),
                               (0.5, torch.float16, 5000, dict(teacher_softcap=2.0, student_logit_scale=1.5)),
                               (0.3, torch.bfloat16, 1271, {})]:
        student = _leaf(2, 6, V, dtype=dtype)
        teacher = torch.randn(2, 6, V, device=DEVICE).to(dtype)
        loss, _ = ops.distill_loss(student[:, :-1], teacher[:, 1:], _mask(2, 5), beta=beta, **kw)
        _grad([loss], student)
        with torch.no_grad():  # NEED_GRAD=False
            ops.distill_loss(student, teacher, _mask(2, 6), beta=beta, **kw)
    # from hidden states: the gradient written in place over the student's chunk of logits
    hidden, weight = _leaf(2, 7, 16, dtype=torch.bfloat16), _leaf(300, 16, dtype=torch.bfloat16)
    loss, _ = ops.linear_distill_loss(hidden, weight, torch.randn(2, 7, 24, device=DEVICE).bfloat16(),
                                      torch.randn(300, 24, device=DEVICE).bfloat16(), _mask(2, 7), beta=0.5,
                                      chunk_size=5)
    _grad([loss], (hidden, weight))


def _decode_attention_calls():
    """kernels/decode_attention.py: the Qwen2.5-0.5B and -7B head shapes (D 64 and 128, H_q / H_kv = 7) in bf16 with
    the dots the GPU runs (the interpreter's bf16 launch converts its tiles to fp32, kernels.dots_in_fp32; its
    values are not looked at here), a prefix of G = 8 rows (64 queries a block, 8 warps) with the tile counts,
    fp16 with L = 4, fp32 (IEEE fp32 dots), and a view of a [B, T, H, D] cache (unaligned strides)."""
    from fastrlhf.kernels import decode_attention as kernels

    def call(B, H_q, H_kv, L, D, T, dtype, G=None, P=300, count=False, layout="bhtd"):
        q = torch.randn(B, H_q, L, D, device=DEVICE).to(dtype)
        if layout == "bhtd":
            k, v = (torch.randn(B, H_kv, T, D, device=DEVICE).to(dtype) for _ in range(2))
        else:
            k, v = (torch.randn(B, T, H_kv, D, device=DEVICE).to(dtype).transpose(1, 2) for _ in range(2))
        lengths = torch.randint(0, T + 1, (B,), device=DEVICE, dtype=torch.int32)
        prefix = None
        if G:
            prefix = (torch.randn(B // G, H_kv, P, D, device=DEVICE).to(dtype),
                      torch.randn(B // G, H_kv, P, D, device=DEVICE).to(dtype),
                      torch.randint(0, P + 1, (B // G,), device=DEVICE), G)
        kernels.decode_attention_fwd(q, k, v, lengths, scale=D**-0.5, prefix=prefix, count_tiles=count)

    with pytest.MonkeyPatch.context() as mp, numpy.errstate(all="ignore"):  # the interpreter's bf16 dot: garbage
        mp.setattr(kernels, "dots_in_fp32", lambda dtype, device: dtype not in kernels.HALF_DTYPES)
        call(2, 14, 2, 1, 64, 300, torch.bfloat16)
        call(8, 28, 4, 1, 128, 300, torch.bfloat16, G=8, count=True)
    call(2, 4, 2, 4, 32, 300, torch.float16, layout="bthd")
    call(4, 4, 1, 1, 16, 200, torch.float32, G=2)


CALLS = (_logprobs_calls, _linear_logprobs_calls, _kl_calls, _gae_calls, _whiten_calls, _loss_calls, _distill_calls,
         _decode_attention_calls)


# ---------------------------------------------------------------- fixtures and tests


@pytest.fixture(scope="module")
def launches():
    """The distinct launches (specs) of every representative call, through the Triton backend."""
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTRLHF_BACKEND", "triton")
        with record_launches() as recorder:
            for call in CALLS:
                call()
    specs = list(recorder.specs.values())
    # an autotuned kernel's configs differ in tile and warps only: each config is compiled for one
    # recorded launch per signature (dtypes), not for every combination of mode flags
    tuned, first = _autotuned(), {}
    for spec in specs:
        first.setdefault(json.dumps([spec["module"], spec["name"], spec["signature"]]), spec)
    variants = [_with_config(spec, config) for spec in first.values()
                for config in tuned.get(f"{spec['module']}.{spec['name']}", ())]
    return list({json.dumps(s, sort_keys=True): s for s in specs + variants}.values())


@pytest.fixture(scope="module")
def compiled(launches):
    """{(kernel, target): [(spec, error or "", the PTX's ex2.approx variants)]}.

    sm_90 compiles every distinct launch. sm_80 compiles one launch per (kernel, signature,
    constexprs): what differs by architecture is the code for each dtype and mode, not the
    divisibility hints or warp counts, and this halves the time.
    """
    per_variant = {}
    for spec in launches:
        per_variant.setdefault(json.dumps([spec["name"], spec["signature"], spec["constexprs"]]), spec)
    jobs = [(spec, TARGETS["sm90"]) for spec in launches] + [(spec, TARGETS["sm80"]) for spec in per_variant.values()]
    by_kernel = {}
    for (spec, target), result in zip(jobs, compile_all(jobs)):
        key = (f"{spec['module']}.{spec['name']}", target)
        by_kernel.setdefault(key, []).append((spec, result["error"] if not result["ok"] else "", result["ex2"]))
    return by_kernel


def test_every_autotune_config_is_compiled(launches):
    """Each config of each autotuned kernel is among the launches compiled, not only the fixed config
    the interpreter takes."""
    tuned = _autotuned()
    assert tuned, "no triton.autotune wrapper found in fastrlhf.kernels"
    for kernel, configs in tuned.items():
        compiled = []
        for spec in launches:
            if f"{spec['module']}.{spec['name']}" == kernel:
                names = list(spec["signature"])
                consts = {names[p[0]]: v for p, v in spec["constexprs"] if len(p) == 1}
                compiled.append((consts, spec["options"].get("num_warps")))
        for config in configs:
            assert any(all(consts.get(k) == v for k, v in config.kwargs.items()) and warps == config.num_warps
                       for consts, warps in compiled), f"{kernel}: {config} is never compiled"


def test_every_kernel_is_launched(launches):
    assert KERNELS, "found no *_kernel in fastrlhf.kernels"
    launched = {f"{s['module']}.{s['name']}" for s in launches}
    missing = sorted(set(KERNELS) - launched)
    assert not missing, f"no representative call launches {missing}: add one to CALLS in {__file__}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles(compiled, kernel, target):
    variants = compiled.get((kernel, TARGETS[target]), [])
    if not variants:
        pytest.fail(f"{kernel} was never launched, so nothing was compiled (see test_every_kernel_is_launched)")
    failures = [f"{describe(spec)}\n{error}" for spec, error, _ in variants if error]
    assert not failures, (f"{kernel}: {len(failures)} of {len(variants)} launch variants fail to compile for "
                          f"{target}:\n\n" + "\n\n".join(failures))


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k.startswith("fastrlhf.kernels.logprobs.")])
def test_logprobs_exponentials_are_bare_ex2(compiled, kernel):
    """The log-prob kernels work in base 2 (kernels/logprobs.py): every exponential is a bare
    `ex2.approx.ftz.f32`, one MUFU.EX2 with no range fix-ups around it. tl.exp would emit
    `ex2.approx.f32` after a multiply by log2(e), which ptxas wraps in a compare, a scale
    and a square for inputs below -126."""
    for target in TARGETS.values():
        for spec, error, ex2 in compiled[(kernel, target)]:
            if not error:
                assert ex2 == ["ex2.approx.ftz.f32"], f"{describe(spec)}: {ex2}"
