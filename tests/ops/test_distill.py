"""ops.distill_loss (teacher-student divergence on logits) against reference.py in float64:
forward, the entropy stat and d(student logits) with a random upstream gradient, on both
backends; masked rows, non-contiguous views, -inf logits, a hand-worked case, bad input.
From hidden states: test_distill_linear.py; against TRL and Liger: tests/integrations/test_distill_peers.py."""

import math

import pytest
import torch
from helpers import assert_close_to_ref, make_mask, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)]  # (dtype, atol)
BETAS = [0.0, 0.5, 1.0, 0.2]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Kernel and torch-path outputs start as NaN: a value the op forgets to write fails the test."""
    poison_outputs(monkeypatch, "fastrlhf.kernels.distill", "fastrlhf.ops.distill")


def _logits(*shape, dtype, scale=2.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


def _upstream(mask, kw):
    """A random upstream gradient times the loss's divisor: d(student) is then O(p), as for a per-token
    output, rather than O(p / n_tokens), which an atol would swallow."""
    n = kw.get("global_num_tokens")
    n = mask.float().sum().clamp(min=1) if n is None else torch.as_tensor(n, dtype=torch.float32)
    return torch.randn(()) * n


def _run(fn, student, teacher, mask, g, **kw):
    """(loss, entropy stat, d(student)) for the upstream gradient g of the loss."""
    leaf = student.detach().clone().requires_grad_()
    loss, stats = fn(leaf, teacher, mask, **kw)
    (grad,) = torch.autograd.grad(loss, leaf, g.to(loss.dtype))
    return loss, stats["entropy"], grad


def _check(student, teacher, mask, atol, *, view=lambda x: x, **kw):
    """The op on view(student) against reference.py in float64 and in the input dtype."""
    g = _upstream(mask, kw)

    def fn(leaf, t, m, **k):
        return ops.distill_loss(view(leaf), view(t), m, **k)

    def ref_fn(leaf, t, m, **k):
        return ref.distill_loss(view(leaf), view(t), m, **k)

    out = _run(fn, student, teacher, mask, g, **kw)
    r64 = _run(ref_fn, student.double(), teacher.double(), mask, g, **kw)
    same = _run(ref_fn, student, teacher, mask, g, **kw)
    for name, o, r, s in zip(("loss", "entropy", "d_student"), out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)
    assert out[0].dtype == torch.float32 and out[2].dtype == student.dtype
    return out


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_matches_reference(backend, dtype, atol, beta):
    """Odd shapes (T = 37, V = 1271), temperature != 1, a mask with right and left padding, gaps and an
    all-masked row."""
    B, T, V = 4, 37, 1271
    student, teacher = _logits(B, T, V, dtype=dtype), _logits(B, T, V, dtype=dtype)
    _check(student, teacher, make_mask(B, T), atol, beta=beta, temperature=0.7)


@pytest.mark.parametrize("beta", BETAS)
def test_scale_softcap_and_views(backend, beta):
    """logits[:, :-1] views read in place (unaligned rows, V odd), a logit scale on one model and a
    softcap on the other, a float mask that weighs tokens."""
    B, T, V = 3, 12, 301
    student, teacher = _logits(B, T + 1, V, dtype=torch.float32), _logits(B, T + 1, V, dtype=torch.float32)
    mask = torch.rand(B, T) * (torch.rand(B, T) > 0.2)
    _check(student, teacher, mask, 1e-5, view=lambda x: x[:, :-1], beta=beta, temperature=1.3,
           student_softcap=3.0, teacher_logit_scale=0.6)
    _check(student, teacher, mask, 1e-5, view=lambda x: x[:, :-1], beta=beta, student_logit_scale=1.7,
           teacher_softcap=4.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_large_vocab(backend, beta):
    student, teacher = _logits(2, 3, 151936, dtype=torch.bfloat16), _logits(2, 3, 151936, dtype=torch.bfloat16)
    _check(student, teacher, torch.tensor([[1, 1, 0], [1, 0, 1]]), 1e-3, beta=beta, temperature=0.9)


@pytest.mark.parametrize("beta", BETAS)
def test_global_num_tokens(backend, beta):
    """TRL's num_items_in_batch: the divisor may be a number or a one-element tensor."""
    student, teacher = _logits(3, 9, 200, dtype=torch.float32), _logits(3, 9, 200, dtype=torch.float32)
    mask = make_mask(3, 9)
    for n in (40, torch.tensor(40.0)):
        _check(student, teacher, mask, 1e-5, beta=beta, global_num_tokens=n)


@pytest.mark.parametrize("beta", BETAS)
def test_masked_rows_never_matter(backend, beta):
    """NaN logits under mask = 0 change nothing and get gradient 0; an empty mask gives loss 0."""
    student, teacher = _logits(2, 6, 97, dtype=torch.float32), _logits(2, 6, 97, dtype=torch.float32)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 2] = mask[1, 5] = False
    clean = _run(ops.distill_loss, student, teacher, mask, torch.tensor(1.3), beta=beta)
    student[0, 2] = float("nan")
    teacher[1, 5] = float("nan")
    dirty = _run(ops.distill_loss, student, teacher, mask, torch.tensor(1.3), beta=beta)
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (dirty[2][0, 2] == 0).all() and (dirty[2][1, 5] == 0).all()
    loss, entropy, grad = _run(ops.distill_loss, student, teacher, torch.zeros(2, 6), torch.tensor(1.0), beta=beta)
    assert loss.item() == 0 and entropy.item() == 0 and (grad == 0).all()


@pytest.mark.parametrize("beta", BETAS)
def test_minus_inf_logits(backend, beta):
    """Tokens both models rule out (-inf logits, e.g. a masked vocabulary) add 0 log 0 = 0: finite loss,
    finite gradients, as the reference's."""
    student, teacher = _logits(2, 5, 130, dtype=torch.float32), _logits(2, 5, 130, dtype=torch.float32)
    student[..., 100:] = float("-inf")
    teacher[..., 100:] = float("-inf")
    loss, entropy, grad = _check(student, teacher, torch.ones(2, 5), 1e-5, beta=beta)
    assert torch.isfinite(grad).all() and (grad[..., 100:] == 0).all()


@pytest.mark.parametrize("beta,want", [
    (0.0, 0.75 * math.log(1.5) + 0.25 * math.log(0.5)),  # KL(t || s)
    (1.0, 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)),  # KL(s || t)
    # m = (0.625, 0.375): 0.5 (KL(t || m) + KL(s || m))
    (0.5, 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375))
     + 0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))),
])
def test_hand_worked(backend, beta, want):
    """V = 2: student logits (0, 0) -> s = (1/2, 1/2); teacher (ln 3, 0) -> t = (3/4, 1/4).
    Forward KL 0.1308, reverse KL 0.1438, JSD(0.5) 0.0338; d(forward KL)/d(student logits) = s - t."""
    student = torch.zeros(1, 1, 2, dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[[math.log(3.0), 0.0]]], dtype=torch.float64)
    loss, _ = ops.distill_loss(student, teacher, torch.ones(1, 1), beta=beta)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, student)
    if beta == 0.0:
        torch.testing.assert_close(grad.flatten(), torch.tensor([-0.25, 0.25], dtype=torch.float64))


def test_teacher_gets_no_gradient(backend):
    student = _logits(2, 3, 50, dtype=torch.float32).requires_grad_()
    teacher = _logits(2, 3, 50, dtype=torch.float32).requires_grad_()
    loss, _ = ops.distill_loss(student, teacher, torch.ones(2, 3), beta=0.5)
    loss.backward()
    assert student.grad is not None and teacher.grad is None


def test_one_backward(backend):
    student = _logits(2, 3, 50, dtype=torch.float32).requires_grad_()
    loss, _ = ops.distill_loss(student, _logits(2, 3, 50, dtype=torch.float32), torch.ones(2, 3), beta=1.0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through one loss twice"):
        loss.backward()


def test_no_grad_forward(backend):
    """Under no_grad no gradient is formed, and the loss is the same."""
    student, teacher = _logits(2, 4, 64, dtype=torch.float32), _logits(2, 4, 64, dtype=torch.float32)
    with torch.no_grad():
        loss, _ = ops.distill_loss(student, teacher, torch.ones(2, 4), beta=0.5)
    want, _ = ref.distill_loss(student.double(), teacher.double(), torch.ones(2, 4), beta=0.5)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(beta=1.5), "beta must be in"),
    (dict(beta=-0.1), "beta must be in"),
    (dict(beta="0.5"), "beta must be a finite real"),
    (dict(beta=0.5, temperature=0.0), "temperature must be > 0"),
    (dict(beta=0.5, student_softcap=0.0), "student_softcap must be > 0"),
    (dict(beta=0.5, teacher_logit_scale=float("nan")), "teacher_logit_scale must be a finite"),
    (dict(beta=0.5, global_num_tokens=0), "global_num_tokens must be > 0"),
    (dict(beta=0.5, global_num_tokens=torch.ones(2)), "global_num_tokens must be a number or a one-element"),
])
def test_bad_arguments(kw, match):
    s, t = torch.randn(2, 3, 10), torch.randn(2, 3, 10)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.distill_loss(s, t, torch.ones(2, 3), **kw)


def test_bad_tensors():
    s = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match="teacher_logits must have the shape of student_logits"):
        ops.distill_loss(s, torch.randn(2, 3, 11), torch.ones(2, 3), beta=0.5)
    with pytest.raises(TypeError, match="student_logits must be a floating-point"):
        ops.distill_loss(s.long(), s, torch.ones(2, 3), beta=0.5)
    with pytest.raises(ValueError, match="mask must have the shape of student_logits.shape"):
        ops.distill_loss(s, s, torch.ones(2, 4), beta=0.5)
    with pytest.raises(TypeError, match="teacher_logits must be a torch.Tensor"):
        ops.distill_loss(s, None, torch.ones(2, 3), beta=0.5)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'beta'"):
        ops.distill_loss(s, s, torch.ones(2, 3))


# ---------------------------------------------------------------- a teacher's top-K support


def _topk_teacher(B, T, V, K, dtype=torch.float64):
    """A teacher's K distinct candidates per position (its most likely first, as a server ranks them), their
    log-probs, and a few padded slots (id -1)."""
    teacher = torch.randn(B, T, V, dtype=dtype) * 2
    lp = teacher.log_softmax(-1)
    top = lp.topk(K, dim=-1)
    ids, logprobs = top.indices.clone(), top.values.clone()
    ids[0, 1, K - 2:] = -1  # fewer candidates at one position
    return ids, logprobs


@pytest.mark.parametrize("tail_bucket", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype,atol", DTYPES[:2])
def test_topk_matches_reference(backend, dtype, atol, beta, tail_bucket):
    B, T, V, K = 3, 11, 301, 8
    student = _logits(B, T, V, dtype=dtype)
    ids, t_lp = _topk_teacher(B, T, V, K)
    mask = make_mask(B, T)
    kw = dict(beta=beta, temperature=0.8, tail_bucket=tail_bucket)
    g = _upstream(mask, kw)

    def fn(leaf, m, module, lp):
        return module.topk_distill_loss(leaf, ids, lp, m, **kw)

    out = _run(lambda s, t, m: fn(s, m, ops, t_lp.float()), student, None, mask, g)
    r64 = _run(lambda s, t, m: fn(s, m, ref, t_lp), student.double(), None, mask, g)
    same = _run(lambda s, t, m: fn(s, m, ref, t_lp.float()), student, None, mask, g)
    for name, o, r, s in zip(("loss", "entropy", "d_student"), out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)


def test_topk_bad_inputs():
    s = torch.randn(2, 3, 10)
    ids, lp = torch.randint(0, 10, (2, 3, 4)), -torch.rand(2, 3, 4)
    with pytest.raises(ValueError, match=r"teacher_ids must have shape student_logits.shape\[:-1\] \+ \(K,\)"):
        ops.topk_distill_loss(s, ids[..., 0], lp, torch.ones(2, 3), beta=0.5)
    with pytest.raises(ValueError, match="teacher_logprobs must have teacher_ids' shape"):
        ops.topk_distill_loss(s, ids, lp[..., :3], torch.ones(2, 3), beta=0.5)
    with pytest.raises(TypeError, match="teacher_ids must be an integer tensor"):
        ops.topk_distill_loss(s, ids.float(), lp, torch.ones(2, 3), beta=0.5)
    with pytest.raises(ValueError, match="mask must have the shape of teacher_ids"):
        ops.topk_distill_loss(s, ids, lp, torch.ones(2, 3), beta=0.5, candidate_mask=torch.ones(2, 3))
