"""Comparison helpers for the integration tests: patched peer function vs the peer's original."""

import functools
import math

import pytest
import torch
from helpers import worst

ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float64: 1e-12}


def as_f64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def check_like_peer(got, peer, peer64, *, atol, name="output"):
    """`got` (patched) has the shape and dtype of `peer` (original, same inputs) and is at
    least as close to `peer64` (original in float64) as DESIGN.md asks: at most twice the
    original's own error plus atol. Tuples, dicts and Python numbers are compared item by item."""
    if isinstance(peer, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(peer), f"{name}: {type(got)} vs {type(peer)}"
        for i, (g, p, p64) in enumerate(zip(got, peer, peer64)):
            check_like_peer(g, p, p64, atol=atol, name=f"{name}[{i}]")
        return
    if isinstance(peer, dict):
        assert isinstance(got, dict) and got.keys() == peer.keys(), f"{name}: keys {sorted(got)} vs {sorted(peer)}"
        for k in peer:
            check_like_peer(got[k], peer[k], peer64[k], atol=atol, name=f"{name}[{k!r}]")
        return
    if peer is None:
        assert got is None, f"{name}: got {got!r}, the peer returns None"
        return
    if isinstance(peer, (int, float)):
        assert type(got) is type(peer), f"{name}: {type(got).__name__} vs the peer's {type(peer).__name__}"
        if not math.isfinite(peer64):
            assert math.isnan(got) if math.isnan(peer64) else got == peer64, f"{name}: {got} vs {peer64}"
            return
        allowed = 2 * abs(peer - peer64) + atol + 2 * torch.finfo(torch.float32).eps * abs(peer64)
        assert abs(got - peer64) <= allowed, f"{name}: {got} vs {peer64} (peer {peer})"
        return
    assert isinstance(got, torch.Tensor), f"{name}: {type(got).__name__}, the peer returns a tensor"
    assert got.shape == peer.shape, f"{name}: shape {tuple(got.shape)} vs the peer's {tuple(peer.shape)}"
    assert got.dtype == peer.dtype, f"{name}: dtype {got.dtype} vs the peer's {peer.dtype}"
    assert got.device == peer.device
    assert_close_to_peer(got, peer64, peer, atol=atol, name=name)


def relative_rounding(dtype: torch.dtype) -> float:
    """The relative rounding allowed for an output of this dtype: 2 eps(float64) for float64 (a
    float64 result is held to float64's precision), else at least 2 eps32 as in
    helpers.assert_close_to_ref (eps of the dtype itself for bf16 / fp16)."""
    if dtype == torch.float64:
        return 2 * torch.finfo(torch.float64).eps
    return max(2 * torch.finfo(torch.float32).eps, torch.finfo(dtype).eps)


def assert_close_to_peer(out, peer64, peer, *, atol, name):
    """DESIGN.md's rule with the peer as the reference: |out - peer64| <= 2 max|peer - peer64|
    + atol + the rounding of the output's own dtype (`rounding(out.dtype)` * |peer64|): a bf16
    result cannot be closer than its last bit, and the Triton interpreter rounds float32 -> bf16
    stores toward zero (up to 1 ulp), where a GPU rounds to nearest. Non-finite values are
    conventions, not rounding: NaN must match NaN and +-inf the same inf, element for element."""
    rounding = relative_rounding(out.dtype)
    out, ref64, same = (x.detach().double().cpu() for x in (out, peer64, peer))
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref64)
    assert torch.equal(nan_out, nan_ref), f"{name}: NaN pattern differs ({int(nan_out.sum())} vs {int(nan_ref.sum())})"
    inf_out, inf_ref = torch.isinf(out), torch.isinf(ref64)
    assert torch.equal(inf_out, inf_ref) and torch.equal(out[inf_out], ref64[inf_ref]), f"{name}: infinities differ"
    ok = torch.isfinite(ref64)
    if not ok.any():
        return
    diff = (out[ok] - ref64[ok]).abs()
    base = (same[ok] - ref64[ok]).abs().nan_to_num(0.0, posinf=0.0).max().item()
    excess = diff - (2 * base + atol + rounding * ref64[ok].abs())
    i = int(excess.argmax())
    where = worst(out.masked_fill(~ok, 0), ref64.masked_fill(~ok, 0))
    assert excess[i] <= 0, f"{name}: err {diff[i].item():.3e} > 2 x {base:.3e} (peer) + atol {atol:.1e}; {where}"


def grads(out, inputs, upstream):
    """d(sum(out * upstream)) / d(inputs), None for inputs that get no gradient."""
    inputs = [x for x in inputs]
    gs = torch.autograd.grad((out * upstream).sum(), inputs, allow_unused=True)
    return tuple(gs)


def compare(patched, original, args, *, diff=(), atol=None, kwargs=None, upstream=None, name="output"):
    """Run `original` on args (input dtype and float64) and `patched` on args; compare the
    outputs, and the gradients w.r.t. the args at indices `diff` (through output 0 when the
    function returns a tuple) with a random upstream gradient."""
    kwargs = kwargs or {}
    cache = {"up": upstream}

    def run(fn, a):
        a = [x.detach().clone().requires_grad_(i in diff) if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(a)]
        out = fn(*a, **kwargs)
        if not diff:
            return out, ()
        head = out[0] if isinstance(out, (tuple, list)) else out
        if cache["up"] is None:
            cache["up"] = torch.randn(head.shape, dtype=torch.float64)
        return out, grads(head, [a[i] for i in diff], cache["up"].to(head.dtype))

    dtype = next(x.dtype for x in args if isinstance(x, torch.Tensor) and x.is_floating_point())
    atol = ATOL[dtype] if atol is None else atol
    got, g_got = run(patched, args)
    peer, g_peer = run(original, args)
    peer64, g_peer64 = run(original, [as_f64(x) for x in args])
    check_like_peer(_detach(got), _detach(peer), _detach(peer64), atol=atol, name=name)
    for i, (a, b, c) in enumerate(zip(g_got, g_peer, g_peer64)):
        if b is None:
            assert a is None or not a.abs().sum(), f"grad {i}: the peer gives none"
            continue
        check_like_peer(a, b, c, atol=atol, name=f"grad {diff[i]}")
    return got, peer


def _detach(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(v) for v in x)
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def unpatched(integration, fn):
    """`fn` run with the integration's patch lifted for the call: a peer's original that looks up
    a patched function by its module global (verl's compute_policy_loss_vanilla -> agg_loss,
    OpenRLHF's PolicyLoss.forward -> aggregate_loss) then runs entirely as the peer ships it."""

    def run(*args, **kwargs):
        integration.unpatch()
        try:
            return fn(*args, **kwargs)
        finally:
            integration.patch()

    return run


def gradient_only(fn):
    """fn's first output minus its detached self: 0 forward (NaN where the output is not finite),
    fn's gradient backward; for comparing gradients where the forward values are checked apart."""

    def run(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out - out.detach()

    return run


def assert_float64_as_peer(patched, original, args, *, diff, kwargs=None, rtol=1e-15):
    """`patched` gives `original`'s float64 output (the first, for a tuple) and its gradient
    w.r.t. args[diff] to `rtol` relative, element for element: for float64 inputs whose results
    are sums of one sign, where float64 rounding is all that may differ. Returns (got, peer)."""
    kwargs = kwargs or {}

    def run(fn):
        a = [x.detach().clone().requires_grad_(i == diff) if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(args)]
        out = fn(*a, **kwargs)
        head = out[0] if isinstance(out, (tuple, list)) else out
        (g,) = torch.autograd.grad(head, a[diff])
        return head.detach(), g

    (got, g_got), (peer, g_peer) = run(patched), run(original)
    assert got.dtype == peer.dtype == torch.float64
    for name, x, ref in (("output", got, peer), ("gradient", g_got, g_peer)):
        err = ((x - ref).abs() / ref.abs().clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e} ({worst(x, ref)})"
    return got, peer


def ratio_tie_inputs():
    """float32 policy-loss inputs (old, logp, adv, ratio, (clip_low, clip_high, dual_clip c))
    whose ratios exp(logp - old), as torch computes them, are exactly the clip bounds: 1 +
    clip_high (token 0, A > 0 in row 0), 1 - clip_low (token 1) and c (token 4, A < 0); the other
    tokens are inside, past the +-20 log-ratio clamp and at ratio 1."""
    old = torch.full((2, 8), -1.0)
    logp = old + torch.tensor([0.25, -0.3, 0.1, -0.1, 1.2, 20.0, -20.0, 0.0])
    ratio = (logp - old).exp()
    clip_high, clip_low, c = ratio[0, 0].item() - 1, 1 - ratio[0, 1].item(), ratio[0, 4].item()
    assert (1 + clip_high, 1 - clip_low) == (ratio[0, 0].item(), ratio[0, 1].item())  # exact ties
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -2.0, 1.0, -1.0, 0.5], [-1.0, 1.0, -1.0, 1.0, -2.0, -1.0, 1.0, -0.5]])
    return old, logp, adv, ratio, (clip_low, clip_high, c)


def grad_of(fn, args, i):
    """d(sum of the first output of fn(*args)) / d(args[i])."""
    a = [x.clone().requires_grad_(j == i) if isinstance(x, torch.Tensor) else x for j, x in enumerate(args)]
    out = fn(*a)
    return torch.autograd.grad((out[0] if isinstance(out, tuple) else out).sum(), a[i])[0]


def clamp_gradient_at_bound() -> float:
    """torch.clamp's gradient at exactly its bound in the installed torch: 1.0 through 2.13, 0.0
    from 2.14 on. The peers' gradients at clip bounds follow it; fastrlhf's rule passes it (1)."""
    x = torch.tensor(1.0, requires_grad=True)
    (g,) = torch.autograd.grad(x.clamp(max=1.0), x)
    return g.item()


def check_ratio_tie_gradients(got, peer, unclipped) -> None:
    """The gradients d/d(logp) at `ratio_tie_inputs`' tokens: fastrlhf's (`got`) and the peer's
    (`peer`) agree inside the clip range (tokens 2, 3, 7); at the ratio-clip bounds and the dual
    clip c (tokens 0, 1, 4) fastrlhf's is the whole unclipped gradient, where the peer's torch.min /
    torch.max split the tie and its clamps pass torch's gradient at the bound g: (1 + g) / 2 of it
    at 1 +- eps, half at c; at the log-ratio clamp's +-20 bounds (tokens 5, 6) the peer's is g
    times fastrlhf's."""
    g = clamp_gradient_at_bound()
    close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=0.0)
    inside = [2, 3, 7]
    torch.testing.assert_close(got[:, inside], peer[:, inside], rtol=1e-6, atol=1e-6)
    close(got[:, [0, 1, 4]], unclipped[:, [0, 1, 4]])  # the ratio-clip bounds and the dual clip c
    close(peer[:, [0, 1]], unclipped[:, [0, 1]] * (1 + g) / 2)
    close(peer[:, 4], unclipped[:, 4] / 2)
    close(peer[:, [5, 6]], got[:, [5, 6]] * g)  # log-ratio +-20: only [1, 6] is neither clipped nor 0


def check_inputs_the_peer_rejects(patched_logprobs, original_logprobs, patched_entropy, original_entropy):
    """The documented answers (each integration's "Not kept") where the peer raises or gives NaN:
    a label of -100 gives log-prob 0 and a label of V gives NaN where the peer's gather raises;
    a -inf logit gives a finite entropy and finite gradients (p = 0 adds nothing) where the
    peer's are NaN. The other positions are the peer's."""
    logits = torch.randn(2, 3, 5)
    for bad in (-100, 5):
        labels = torch.randint(0, 5, (2, 3))
        # The peer's gather is asked on CPU: on CUDA an index out of bounds is a device-side assert
        # that leaves the process's CUDA context unusable for every later test.
        peer_labels = labels.to("cpu", copy=True)
        peer_labels[:, 1] = bad
        with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
            original_logprobs(logits.to("cpu", copy=True), peer_labels)
        want = original_logprobs(logits.clone(), labels)
        labels[:, 1] = bad
        got = patched_logprobs(logits.clone(), labels)
        assert bool((got[:, 1] == 0).all() if bad == -100 else got[:, 1].isnan().all())
        torch.testing.assert_close(got[:, [0, 2]], want[:, [0, 2]], rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 5)
    x[0, 1] = -float("inf")
    got, peer = (grad_of(fn, [x], 0) for fn in (patched_entropy, original_entropy))
    assert bool(peer.isnan().any()) and bool(got.isfinite().all())
    torch.testing.assert_close(got[1], peer[1], rtol=1e-5, atol=1e-6)
    value = patched_entropy(x)
    finite = x[0, [0, 2, 3, 4]]
    torch.testing.assert_close(value[0], torch.special.entr(finite.softmax(-1)).sum(), rtol=1e-6, atol=1e-6)
    assert bool(original_entropy(x)[0].isnan())
