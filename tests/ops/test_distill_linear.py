"""ops.linear_distill_loss (both models' hidden states and lm_heads, chunked) against the reference
on materialised logits in float64: the loss, the entropy stat and the student's gradients (hidden,
weight, bias) with a random upstream gradient, on both backends; chunking, teacher shapes and dtypes,
the memory rule (no [N, V] logits), bad input."""

import weakref

import pytest
import torch
from helpers import assert_close_to_ref, make_mask, poison_outputs
from test_distill import _upstream

from fastrlhf import ops
from fastrlhf import reference as ref
from fastrlhf.ops import distill

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)]  # (dtype, atol)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    poison_outputs(monkeypatch, "fastrlhf.kernels.distill", "fastrlhf.ops.distill")


def _model(lead, H, V, dtype, bias=True):
    """(hidden, weight, bias) with logits of std ~2."""
    hidden = torch.randn(*lead, H, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, dtype=torch.float64) * 2 / H**0.5).to(dtype)
    b = torch.randn(V, dtype=torch.float64).to(dtype) if bias else None
    return hidden, weight, b


def _run(fn, student, teacher, mask, g, **kw):
    """(loss, entropy, d_hidden, d_weight[, d_bias]) for the upstream gradient g."""
    leaves = [t.detach().clone().requires_grad_() for t in student if t is not None]
    hs, ws = leaves[:2]
    bs = leaves[2] if len(leaves) > 2 else None
    ht, wt, bt = teacher
    loss, stats = fn(hs, ws, ht, wt, mask, student_bias=bs, teacher_bias=bt, **kw)
    grads = torch.autograd.grad(loss, leaves, g.to(loss.dtype))
    return (loss, stats["entropy"], *grads)


def _check(student, teacher, mask, atol, **kw):
    g = _upstream(mask, kw)
    ref_kw = {k: v for k, v in kw.items() if k not in ("chunk_size", "accum_dtype")}
    out = _run(ops.linear_distill_loss, student, teacher, mask, g, **kw)
    as64 = lambda m: tuple(None if t is None else t.double() for t in m)  # noqa: E731
    r64 = _run(ref.linear_distill_loss, as64(student), as64(teacher), mask, g, **ref_kw)
    same = _run(ref.linear_distill_loss, student, teacher, mask, g, **ref_kw)
    names = ("loss", "entropy", "d_hidden", "d_weight", "d_bias")
    for name, o, r, s in zip(names, out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)
    assert out[0].dtype == torch.float32
    assert out[2].dtype == student[0].dtype and out[3].dtype == student[1].dtype
    return out


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_matches_reference(backend, dtype, atol, beta):
    """[B, T, H] hidden, odd sizes (T = 37, V = 1271), a wider teacher (H_t = 40 vs H_s = 24), biases on
    both, chunks that do not divide N, temperature != 1, masked rows."""
    B, T, V = 3, 37, 1271
    _check(_model((B, T), 24, V, dtype), _model((B, T), 40, V, dtype), make_mask(B, T), atol, beta=beta,
           temperature=0.8, chunk_size=16)


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 200])
def test_chunk_sizes(backend, chunk_size):
    """[N, H] hidden, no biases: a chunk of one row, a ragged last chunk, one chunk for all, auto."""
    N, V = 23, 300
    _check(_model((N,), 16, V, torch.float32, bias=False), _model((N,), 16, V, torch.float32, bias=False),
           torch.rand(N) > 0.3, 1e-5, beta=0.5, chunk_size=chunk_size)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_in_another_dtype_scale_softcap(backend, beta):
    """A bf16 teacher for an fp32 student, a softcap on the student and a logit scale on the teacher
    (TRL's arguments), global_num_tokens."""
    N, V = 19, 257
    teacher = _model((N,), 32, V, torch.bfloat16)
    student = _model((N,), 16, V, torch.float32)
    kw = dict(beta=beta, temperature=1.2, student_softcap=4.0, teacher_logit_scale=0.7, global_num_tokens=25)
    # the reference gets the teacher's logits as the op makes them (bf16 matmuls of 6-row chunks), through
    # an identity lm_head, and then runs in fp64
    ht, wt, bt = teacher
    t_logits = torch.cat([distill.chunk_logits(ht[i:i + 6], wt, bt) for i in range(0, N, 6)]).double()
    eye = torch.eye(V, dtype=torch.float64)
    as64 = tuple(t.double() for t in student)
    mask = torch.rand(N) > 0.2
    g = _upstream(mask, kw)
    out = _run(ops.linear_distill_loss, student, teacher, mask, g, chunk_size=6, **kw)
    r64 = _run(ref.linear_distill_loss, as64, (t_logits, eye, None), mask, g, **kw)
    same = _run(ref.linear_distill_loss, student, (t_logits.float(), eye.float(), None), mask, g, **kw)
    for name, o, r, s in zip(("loss", "entropy", "d_hidden", "d_weight", "d_bias"), out, r64, same):
        assert_close_to_ref(o, r, s, atol=1e-5, name=name)


def test_accum_dtype_and_frozen_weight(backend):
    """accum_dtype=weight.dtype accumulates d(weight) in bf16; a frozen student weight gets no gradient
    (only d(hidden) is formed)."""
    N, V = 40, 500
    student, teacher = _model((N,), 16, V, torch.bfloat16), _model((N,), 16, V, torch.bfloat16)
    _check(student, teacher, torch.rand(N) > 0.2, 1e-3, beta=1.0, chunk_size=7, accum_dtype=torch.bfloat16)
    hs = student[0].clone().requires_grad_()
    loss, _ = ops.linear_distill_loss(hs, student[1], teacher[0], teacher[1], torch.ones(N), beta=1.0, chunk_size=7)
    (g,) = torch.autograd.grad(loss, hs)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_logits_are_never_materialised(backend, monkeypatch):
    """No [N, V] buffer: every logits tensor the op makes has at most chunk_size rows, and one chunk of
    each model's logits is alive at a time (a chunk's are freed before the next chunk's are made)."""
    made = []
    real = distill.chunk_logits

    def tracked(h, weight, bias):
        alive = sum(r() is not None for r in made)
        assert alive <= 1, f"{alive} earlier logits chunks alive when another is made"
        out = real(h, weight, bias)
        made.append(weakref.ref(out))
        rows.append(out.shape[0])
        return out

    rows = []
    monkeypatch.setattr(distill, "chunk_logits", tracked)
    N, V = 50, 300
    student, teacher = _model((N,), 16, V, torch.float32), _model((N,), 16, V, torch.float32)
    _check(student, teacher, torch.ones(N), 1e-5, beta=0.5, chunk_size=8)
    assert max(rows) <= 8
    assert len(rows) == 2 * -(-N // 8)  # one chunk of each model per 8 rows, nothing recomputed


def test_bad_inputs():
    h, w = torch.randn(4, 8), torch.randn(30, 8)
    m = torch.ones(4)
    with pytest.raises(ValueError, match="teacher_weight must have the student's vocabulary V = 30"):
        ops.linear_distill_loss(h, w, h, torch.randn(31, 8), m, beta=0.5)
    with pytest.raises(ValueError, match="teacher_hidden must have student_hidden's leading shape"):
        ops.linear_distill_loss(h, w, torch.randn(5, 8), w, m, beta=0.5)
    with pytest.raises(ValueError, match=r"student_weight must be \[V, H\]"):
        ops.linear_distill_loss(h, torch.randn(30, 9), h, w, m, beta=0.5)
    with pytest.raises(TypeError, match="teacher_weight must have teacher_hidden's dtype"):
        ops.linear_distill_loss(h, w, h, w.double(), m, beta=0.5)
    with pytest.raises(ValueError, match=r"student_bias must be \[V\]"):
        ops.linear_distill_loss(h, w, h, w, m, beta=0.5, student_bias=torch.randn(29))
    with pytest.raises(ValueError, match="mask must have the shape of student_hidden.shape"):
        ops.linear_distill_loss(h, w, h, w, torch.ones(5), beta=0.5)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ops.linear_distill_loss(h, w, h, w, m, beta=0.5, chunk_size=0)
    with pytest.raises(TypeError, match="accum_dtype must be None or a floating-point"):
        ops.linear_distill_loss(h, w, h, w, m, beta=0.5, accum_dtype=torch.int32)
    with pytest.raises(ValueError, match="beta must be in"):
        ops.linear_distill_loss(h, w, h, w, m, beta=2.0)
    with pytest.raises(TypeError, match="logits_dtype must be None or a floating-point"):
        ops.linear_distill_loss(h, w, h, w, m, beta=0.5, logits_dtype="float32")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fp32_logits_from_half_models(backend, beta):
    """logits_dtype=torch.float32 (TRL's and Liger's projection): from bf16 models the loss and the entropy
    are as accurate as the float32 reference on the same (exactly widened) inputs; the gradients, formed in
    bf16 for the bf16 matmuls, as the bf16 reference's."""
    N, V = 29, 700
    student, teacher = _model((N,), 24, V, torch.bfloat16), _model((N,), 40, V, torch.bfloat16)
    mask = torch.rand(N) > 0.2
    g = _upstream(mask, {})
    kw = dict(beta=beta, temperature=0.9)
    out = _run(ops.linear_distill_loss, student, teacher, mask, g, chunk_size=8, logits_dtype=torch.float32, **kw)
    widen = lambda m, dtype: tuple(None if t is None else t.to(dtype) for t in m)  # noqa: E731
    r64 = _run(ref.linear_distill_loss, widen(student, torch.float64), widen(teacher, torch.float64), mask, g, **kw)
    r32 = _run(ref.linear_distill_loss, widen(student, torch.float32), widen(teacher, torch.float32), mask, g, **kw)
    r16 = _run(ref.linear_distill_loss, student, teacher, mask, g, **kw)
    for name, o, r, s32, s16 in zip(("loss", "entropy", "d_hidden", "d_weight", "d_bias"), out, r64, r32, r16):
        if name in ("loss", "entropy"):
            assert_close_to_ref(o, r, s32, atol=1e-5, name=name)
        else:
            assert_close_to_ref(o, r, s16, atol=1e-3, name=name)
            assert o.dtype == torch.bfloat16
