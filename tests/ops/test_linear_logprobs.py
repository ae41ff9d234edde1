"""ops.linear_logprobs (chunked lm_head + log-probs) against the reference on materialised
logits in float64: forward, and gradients for hidden, weight and bias, on both backends.
The fused actor loss from hidden states is in test_linear_actor_fused.py."""

import pytest
import torch
from helpers import assert_close_to_ref, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref
from fastrlhf.ops import linear

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)]  # (dtype, atol)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Kernel and torch-path outputs start as NaN: a value the op forgets to write fails the test."""
    poison_outputs(monkeypatch, "fastrlhf.kernels.logprobs", "fastrlhf.ops.logprobs", "fastrlhf.ops.linear")


def _inputs(lead_shape, H, V, dtype, bias=True):
    hidden = torch.randn(*lead_shape, H).to(dtype)
    weight = (torch.randn(V, H) * 2 / H**0.5).to(dtype)  # logits of std ~2
    b = torch.randn(V).to(dtype) if bias else None
    labels = torch.randint(0, V, lead_shape)
    flat = labels.view(-1)
    flat[1] = -100  # ignored: logp 0, no gradient
    flat[2] = V + 4  # out of range: NaN
    return hidden, weight, b, labels


def _fwd_bwd(fn, hidden, weight, bias, labels, g_logp, g_ent, **kw):
    """(logp, entropy, d_hidden, d_weight, d_bias) for upstream gradients (g_logp, g_ent)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    b = leaves[2] if bias is not None else None
    logp, ent = fn(leaves[0], leaves[1], labels, bias=b, return_entropy=True, **kw)
    grads = torch.autograd.grad((logp, ent), leaves, (g_logp.to(logp.dtype), g_ent.to(ent.dtype)))
    return (logp, ent, *grads)


def _check(hidden, weight, bias, labels, atol, **kw):
    g_logp, g_ent = torch.randn(labels.shape), torch.randn(labels.shape)
    out = _fwd_bwd(ops.linear_logprobs, hidden, weight, bias, labels, g_logp, g_ent, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "chunk_size"}
    r64 = _fwd_bwd(ref.linear_logprobs, hidden.double(), weight.double(), None if bias is None else bias.double(),
                   labels, g_logp, g_ent, **ref_kw)
    same = _fwd_bwd(ref.linear_logprobs, hidden, weight, bias, labels, g_logp, g_ent, **ref_kw)
    names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
    for name, o, r, s in zip(names, out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)
    assert out[0].dtype == torch.float32 and out[2].dtype == hidden.dtype and out[3].dtype == weight.dtype
    return out


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_linear_logprobs_matches_reference(backend, dtype, atol):
    """[B, T, H] hidden, odd sizes (T = 37, H = 24, V = 1271), chunks that do not divide N."""
    hidden, weight, bias, labels = _inputs((2, 37), 24, 1271, dtype)
    logp, *_ = _check(hidden, weight, bias, labels, atol, temperature=0.8, chunk_size=16)
    assert logp.shape == (2, 37)
    assert logp.view(-1)[1] == 0 and torch.isnan(logp.view(-1)[2])


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 200])
def test_chunk_sizes_and_flat_hidden(backend, chunk_size):
    """[N, H] hidden, no bias, chunk of one row, ragged last chunk, one chunk for all, auto."""
    hidden, weight, _, labels = _inputs((23,), 37, 300, torch.float32, bias=False)
    _check(hidden, weight, None, labels, 1e-5, chunk_size=chunk_size)


def test_large_vocab(backend):
    hidden, weight, bias, labels = _inputs((3,), 16, 151936, torch.bfloat16)
    _check(hidden, weight, bias, labels, 1e-3, chunk_size=2)


def test_logits_are_never_materialised(backend, monkeypatch):
    """No [N, V] buffer: every logits tensor the op makes has at most chunk_size rows."""
    rows = []
    real = linear.chunk_logits

    def spy(h, weight, bias):
        rows.append(h.shape[0])
        return real(h, weight, bias)

    monkeypatch.setattr(linear, "chunk_logits", spy)
    hidden, weight, bias, labels = _inputs((4, 10), 8, 64, torch.float32)
    h = hidden.requires_grad_()
    logp = ops.linear_logprobs(h, weight, labels, bias=bias, chunk_size=7)
    torch.nan_to_num(logp).sum().backward()
    assert max(rows) == 7 and sum(rows) == 2 * 40  # forward and the backward's recompute


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_chunk_size_follows_the_budget(cuda):
    """As few chunks as the budget allows, of balanced sizes: 8 chunks of 2048 rows at the linear
    target shape on CUDA."""
    V, esize, N = 151936, 2, 16384
    budget = linear.CHUNK_BUDGET_BYTES_CUDA if cuda else linear.CHUNK_BUDGET_BYTES
    chunk = linear.auto_chunk_size(N, V, esize, cuda)
    assert chunk * V * esize <= budget and chunk % linear.CHUNK_MULTIPLE == 0
    most = budget // (V * esize) // linear.CHUNK_MULTIPLE * linear.CHUNK_MULTIPLE  # the largest chunk that fits
    assert -(-N // chunk) == -(-N // most), "no more chunks than the largest fitting chunk needs"
    if cuda:
        assert chunk == 2048
    assert linear.auto_chunk_size(5, 1000, 4, cuda) == 5  # never more rows than N
    assert linear.auto_chunk_size(10, 2**40, 4, cuda) == 1  # at least one row


def test_frozen_weight_and_hidden_only(backend):
    """Only the gradients that are asked for are formed."""
    hidden, weight, bias, labels = _inputs((9,), 12, 77, torch.float32)
    h = hidden.requires_grad_()
    logp = ops.linear_logprobs(h, weight, labels, bias=bias, chunk_size=4)
    g = torch.randn(9)
    torch.autograd.grad(torch.nan_to_num(logp), h, g)  # weight and bias need no grad: must not fail
    w = weight.clone().requires_grad_()
    logp = ops.linear_logprobs(hidden, w, labels, chunk_size=4)
    (dw,) = torch.autograd.grad(torch.nan_to_num(logp), w, g)
    expected = torch.autograd.grad(torch.nan_to_num(ref.linear_logprobs(hidden.double(), w.double(), labels)), w,
                                   g.double())[0]
    torch.testing.assert_close(dw, expected, atol=1e-5, rtol=0)


def test_tied_weights(backend):
    """lm_head tied to the embedding: both uses' gradients land in the one Parameter."""
    V, H = 211, 16
    emb = torch.nn.Embedding(V, H)
    ids = torch.randint(0, V, (2, 9))
    labels = torch.randint(0, V, (2, 9))
    g = torch.randn(2, 9)

    def grad_of(fn, weight):
        hidden = torch.tanh(torch.nn.functional.embedding(ids, weight))
        (d,) = torch.autograd.grad(fn(hidden, weight, labels, temperature=1.1), weight, g.to(weight.dtype))
        return d

    d = grad_of(lambda *a, **kw: ops.linear_logprobs(*a, chunk_size=5, **kw), emb.weight)
    w64 = emb.weight.detach().double().requires_grad_()
    d64 = grad_of(ref.linear_logprobs, w64)
    d32 = grad_of(ref.linear_logprobs, emb.weight)
    assert_close_to_ref(d, d64, d32, atol=1e-5, name="d_embedding")
    # and through .backward() into the Parameter's .grad
    hidden = torch.tanh(emb(ids))
    (ops.linear_logprobs(hidden, emb.weight, labels, temperature=1.1, chunk_size=5) * g).sum().backward()
    torch.testing.assert_close(emb.weight.grad, d, atol=1e-6, rtol=1e-5)


def test_empty(backend):
    logp, ent = ops.linear_logprobs(torch.randn(0, 8), torch.randn(5, 8), torch.zeros(0, dtype=torch.long),
                                    return_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)


# ---------------------------------------------------------------- bad input


def test_hidden_weight_size_mismatch():
    with pytest.raises(ValueError, match="weight must be"):
        ops.linear_logprobs(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))


def test_label_shape_mismatch():
    with pytest.raises(ValueError, match="labels must have shape"):
        ops.linear_logprobs(torch.randn(2, 4, 8), torch.randn(10, 8), torch.zeros(8, dtype=torch.long))


def test_bad_bias_dtype_chunk_and_labels():
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="bias"):
        ops.linear_logprobs(h, w, y, bias=torch.randn(9))
    with pytest.raises(TypeError, match="weight must have hidden's dtype"):
        ops.linear_logprobs(h, w.half(), y)
    with pytest.raises(ValueError, match="chunk_size"):
        ops.linear_logprobs(h, w, y, chunk_size=0)
    with pytest.raises(TypeError, match="labels"):
        ops.linear_logprobs(h, w, y.float())
    with pytest.raises(TypeError, match="hidden"):
        ops.linear_logprobs(h.long(), w, y)
    with pytest.raises(ValueError, match="temperature"):
        ops.linear_logprobs(h, w, y, temperature=0.0)
