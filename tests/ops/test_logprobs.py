"""ops.logprobs (log-prob + entropy, forward and backward) against reference.py in float64,
on both backends: err(op vs ref64) <= 2 * err(reference in the same dtype vs ref64) + atol."""

import importlib

import pytest
import torch
from conftest import DEVICE
from helpers import assert_close_to_ref, poison_outputs

from fastrlhf import ops
from fastrlhf import reference as ref
from fastrlhf.kernels import logprobs as kernels
from fastrlhf.ops.logprobs import writable_in_place

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)]  # (dtype, atol)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Kernel and torch-path outputs start as NaN: a value the op forgets to write fails the test."""
    poison_outputs(monkeypatch, "fastrlhf.kernels.logprobs", "fastrlhf.ops.logprobs")


def _labels(B, T, V, ignore_index=-100):
    """Random labels with one ignored and one out-of-range (-> NaN) position per row when T allows."""
    y = torch.randint(0, V, (B, T))
    if T >= 3:
        y[:, 1] = ignore_index
        y[0, 2] = V + 7
        y[-1, 2] = -3 if ignore_index != -3 else -4
    return y


def _fwd_bwd(fn, logits, labels, g_logp, g_ent, clone=True, **kw):
    """logp, entropy, d(logits) for upstream gradients (g_logp, g_ent); clone=False: of `logits` itself
    (a view of a leaf that requires grad), in its own layout."""
    x = logits.detach().clone().requires_grad_() if clone else logits
    logp, ent = fn(x, labels, return_entropy=True, **kw)
    (dx,) = torch.autograd.grad((logp, ent), x, (g_logp.to(logp.dtype), g_ent.to(ent.dtype)))
    return logp, ent, dx


def _check_against_reference(backend_fn, logits, labels, atol, **kw):
    B_T = labels.shape
    g_logp, g_ent = torch.randn(B_T), torch.randn(B_T)
    out = _fwd_bwd(backend_fn, logits, labels, g_logp, g_ent, **kw)
    r64 = _fwd_bwd(ref.logprobs, logits.double(), labels, g_logp, g_ent, **kw)
    same = _fwd_bwd(ref.logprobs, logits, labels, g_logp, g_ent, **kw)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    assert out[2].dtype == logits.dtype
    for name, o, r, s in zip(("logp", "entropy", "d_logits"), out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)
    return out


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_matches_reference(backend, dtype, atol, temperature):
    B, T, V = 2, 37, 1271
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    labels = _labels(B, T, V)
    logp, _, dx = _check_against_reference(ops.logprobs, logits, labels, atol, temperature=temperature)
    assert (logp[:, 1] == 0).all(), "ignore_index must give 0"
    assert torch.isnan(logp[0, 2]) and torch.isnan(logp[-1, 2]), "out-of-range labels must give NaN"
    assert torch.isfinite(dx).all(), "out-of-range labels must not poison the gradient"


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)])
def test_large_vocab(backend, dtype, atol):
    V = 151936
    logits = (torch.randn(1, 3, V) * 4).to(dtype)
    labels = torch.randint(0, V, (1, 3))
    labels[0, 0] = V - 1  # the last column, past the last full tile
    _check_against_reference(ops.logprobs, logits, labels, atol, temperature=1.3)


def test_custom_ignore_index_and_fully_ignored_rows(backend):
    B, T, V = 3, 9, 300
    logits = torch.randn(B, T, V)
    labels = torch.randint(1, V, (B, T))
    labels[1] = 0  # every label of row 1 is ignored
    labels[0, 4] = 0
    labels[2, 0] = -100  # not the ignore index here: out of range -> NaN
    logp, ent, dx = _check_against_reference(ops.logprobs, logits, labels, 1e-5, ignore_index=0)
    assert (logp[1] == 0).all() and logp[0, 4] == 0 and torch.isnan(logp[2, 0])
    # the ignored row gets gradient only through the entropy
    g_ent = torch.randn(B, T)
    x = logits.clone().requires_grad_()
    lp, en = ops.logprobs(x, labels, return_entropy=True, ignore_index=0)
    (d_logp_only,) = torch.autograd.grad(lp, x, torch.randn(B, T), retain_graph=True)
    assert (d_logp_only[1] == 0).all() and (d_logp_only[0, 4] == 0).all()
    (d_ent_only,) = torch.autograd.grad(en, x, g_ent)
    assert (d_ent_only[1].abs().sum(-1) > 0).all()


def test_logp_only_backward(backend):
    """return_entropy=False: the backward has a log-prob gradient only."""
    B, T, V = 2, 5, 97
    logits = torch.randn(B, T, V, dtype=torch.float16)
    labels = torch.randint(0, V, (B, T))
    g = torch.randn(B, T)
    outs = []
    for fn, x in ((ops.logprobs, logits), (ref.logprobs, logits.double()), (ref.logprobs, logits)):
        x = x.clone().requires_grad_()
        lp = fn(x, labels, temperature=0.9)
        (dx,) = torch.autograd.grad(lp, x, g.to(lp.dtype))
        outs.append((lp, dx))
    for i, name in enumerate(("logp", "d_logits")):
        assert_close_to_ref(outs[0][i], outs[1][i], outs[2][i], atol=1e-3, name=name)


def test_shapes_1d_2d_4d(backend):
    V = 50
    for shape in ((V,), (6, V), (2, 3, 4, V)):
        logits = torch.randn(shape)
        labels = torch.randint(0, V, shape[:-1])
        _check_against_reference(ops.logprobs, logits, labels, 1e-5)


def test_empty(backend):
    logp, ent = ops.logprobs(torch.randn(0, 5, 11), torch.zeros(0, 5, dtype=torch.long), return_entropy=True)
    assert logp.shape == (0, 5) and ent.shape == (0, 5)


def test_logits_not_mutated(backend):
    full = torch.randn(2, 9, 123, dtype=torch.bfloat16)
    before = full.clone()
    x = full.requires_grad_()
    logp, ent = ops.logprobs(x[:, :-1], torch.randint(0, 123, (2, 8)), return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.equal(full.detach(), before)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_non_contiguous_view(backend, dtype, atol):
    """logits[:, :-1] of a contiguous [B, T+1, V] tensor, as in a causal-LM loss."""
    B, T, V = 2, 37, 1271
    full = torch.randn(B, T + 1, V).to(dtype)
    view = full[:, :-1]
    assert not view.is_contiguous()
    _check_against_reference(ops.logprobs, view, _labels(B, T, V), atol, temperature=0.8)


def test_triton_reads_the_view_without_copy(triton_backend, monkeypatch):
    """The kernel gets the caller's storage (no hidden full copy of logits[:, :-1])."""
    from fastrlhf.kernels import logprobs as k

    seen = []
    real = k.logprobs_fwd

    def spy(logits, labels, **kw):
        seen.append((logits.data_ptr(), logits.stride()))
        return real(logits, labels, **kw)

    monkeypatch.setattr(k, "logprobs_fwd", spy)
    full = torch.randn(2, 11, 64)
    ops.logprobs(full[:, :-1], torch.randint(0, 64, (2, 10)))
    assert seen == [(full.data_ptr(), full.stride())]


def test_inplace_backward_writes_into_logits_storage(backend):
    """inplace_backward=True: d(logits) lands in the storage of the (non-contiguous) logits view."""
    B, T, V = 2, 9, 301
    full = torch.randn(B, T + 1, V, dtype=torch.bfloat16)
    last_column = full[:, -1].clone()
    labels = _labels(B, T, V)
    g_logp, g_ent = torch.randn(B, T), torch.randn(B, T)
    # the same op out of place on a copy of the same layout: the torch path's row blocks and reductions
    # are those of the in-place run (on CUDA a reduction's rounding depends on the shape it runs over)
    copy = full.clone().requires_grad_()
    expected = _fwd_bwd(ops.logprobs, copy[:, :-1], labels, g_logp, g_ent, clone=False)[2]

    leaf = full.requires_grad_()
    view = leaf[:, :-1]
    logp, ent = ops.logprobs(view, labels, return_entropy=True, inplace_backward=True)
    (dx,) = torch.autograd.grad((logp, ent), view, (g_logp, g_ent))
    assert dx.data_ptr() == full.data_ptr() and dx.stride() == full.stride()
    assert torch.equal(dx, expected)
    assert torch.equal(full.detach()[:, :-1], expected), "the logits' storage now holds d(logits)"
    assert torch.equal(full.detach()[:, -1], last_column), "outside the view nothing is written"


def test_inplace_backward_bumps_the_version_counter(backend):
    """Another node that saved the logits for its backward raises after the in-place backward has
    overwritten them, instead of computing its gradient from d(logits)."""
    B, T, V = 2, 5, 33
    labels = torch.randint(0, V, (B, T))
    leaf = torch.randn(B, T, V, requires_grad=True)
    logits = leaf * 1.0
    version = logits._version
    square = (logits * logits).sum()  # MulBackward saves `logits`
    logp = ops.logprobs(logits, labels, inplace_backward=True)  # created later: its backward runs first
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (logp.sum() + square).backward()
    assert logits._version > version

    # without the in-place backward the same graph is fine: 2 x logits plus d(logp)/d(logits)
    logits = leaf * 1.0
    square = (logits * logits).sum()
    logp = ops.logprobs(logits, labels)
    (logp.sum() + square).backward()
    p = torch.softmax(leaf.detach(), -1)
    d_logp = torch.nn.functional.one_hot(labels, V) - p
    torch.testing.assert_close(leaf.grad, 2 * leaf.detach() + d_logp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_topk_labels_match_reference(backend, dtype, atol):
    """labels [..., K]: K log-probs per position (TRL's selective_log_softmax with a (..., K) index),
    ignored and out-of-range labels among them; the entropy stays [...]."""
    B, T, V, K = 2, 13, 1271, 4
    logits = (torch.randn(B, T + 1, V) * 3).to(dtype)[:, :-1]  # a non-contiguous view
    labels = torch.randint(0, V, (B, T, K))
    labels[:, 1, 0] = -100
    labels[0, 2, 3] = V + 7
    labels[1, 3, 1] = labels[1, 3, 2]  # a label twice at one position
    g_logp, g_ent = torch.randn(B, T, K), torch.randn(B, T)
    out = _fwd_bwd(ops.logprobs, logits, labels, g_logp, g_ent, temperature=0.7)
    r64 = _fwd_bwd(ref.logprobs, logits.double(), labels, g_logp, g_ent, temperature=0.7)
    same = _fwd_bwd(ref.logprobs, logits, labels, g_logp, g_ent, temperature=0.7)
    assert out[0].shape == (B, T, K) and out[1].shape == (B, T)
    for name, o, r, s in zip(("logp", "entropy", "d_logits"), out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)
    assert (out[0][:, 1, 0] == 0).all() and torch.isnan(out[0][0, 2, 3])
    # K = 1 is the per-position op with a trailing dimension
    one = ops.logprobs(logits, labels[..., :1], temperature=0.7)
    torch.testing.assert_close(one.squeeze(-1), ops.logprobs(logits, labels[..., 0], temperature=0.7), rtol=0,
                               atol=0)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_entropy_matches_reference(backend, dtype, atol):
    """The entropy-only op: one read of the logits, a gradient to them; -inf logits give 0 log 0 = 0."""
    B, T, V = 2, 13, 1271
    logits = (torch.randn(B, T, V) * 3).to(dtype)
    logits[0, 3, 100:] = float("-inf")
    g = torch.randn(B, T)
    outs = []
    for fn, x in ((ops.entropy, logits), (ref.entropy, logits.double()), (ref.entropy, logits)):
        x = x.clone().requires_grad_()
        h = fn(x, temperature=1.3)
        outs.append((h, torch.autograd.grad(h, x, g.to(h.dtype))[0]))
    assert outs[0][0].dtype == torch.float32 and outs[0][1].dtype == dtype
    for i, name in enumerate(("entropy", "d_logits")):
        assert_close_to_ref(outs[0][i], outs[1][i], outs[2][i], atol=atol, name=name)
    assert torch.isfinite(outs[0][1]).all()
    # the same numbers as the entropy logprobs returns
    _, h = ops.logprobs(logits, torch.randint(0, 100, (B, T)), temperature=1.3, return_entropy=True)
    torch.testing.assert_close(outs[0][0], h, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_torch_path_blocks_of_rows(monkeypatch, dtype, atol):
    """The torch path's blocks of rows, one row each here: block edges, a view that cannot be
    flattened (one span per sequence), K labels, the in-place backward."""
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    monkeypatch.setattr(importlib.import_module("fastrlhf.ops.logprobs"), "BLOCK_BYTES_PER_THREAD", 1)
    B, T, V = 2, 7, 1271
    full = (torch.randn(B, T + 1, V) * 3).to(dtype)
    labels = _labels(B, T, V)
    _check_against_reference(ops.logprobs, full[:, :-1], labels, atol, temperature=0.9)
    g_logp, g_ent = torch.randn(B, T, 3), torch.randn(B, T)
    topk = torch.randint(0, V, (B, T, 3))
    out = _fwd_bwd(ops.logprobs, full[:, :-1], topk, g_logp, g_ent)
    r64 = _fwd_bwd(ref.logprobs, full[:, :-1].double(), topk, g_logp, g_ent)
    same = _fwd_bwd(ref.logprobs, full[:, :-1], topk, g_logp, g_ent)
    for name, o, r, s in zip(("logp", "entropy", "d_logits"), out, r64, same):
        assert_close_to_ref(o, r, s, atol=atol, name=name)
    leaf = full.clone().requires_grad_()
    view = leaf[:, :-1] * 1.0
    logp, ent = ops.logprobs(view, topk, return_entropy=True, inplace_backward=True)
    (dx,) = torch.autograd.grad((logp, ent), view, (g_logp, g_ent))
    torch.testing.assert_close(dx, out[2], rtol=0, atol=0)


@pytest.mark.parametrize("config", kernels.CONFIGS, ids=lambda c: f"{c.kwargs['BLOCK_V']}x{c.num_warps}")
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)])
def test_every_autotune_config_matches_reference(triton_backend, monkeypatch, config, dtype, atol):
    """Each tile x warps config the CUDA autotuner may pick, run through the Triton kernels (in the
    interpreter as the fixed config; on CUDA as the autotuner's only config): a vocab of two full
    16384 tiles and a partial one, the label in the last column, -inf logits, temperature != 1."""
    monkeypatch.setattr(kernels, "fixed_config",
                        lambda V: {"BLOCK_V": config.kwargs["BLOCK_V"], "num_warps": config.num_warps})
    for tuned in (kernels._logprobs_fwd_tuned, kernels._logprobs_bwd_tuned):
        monkeypatch.setattr(tuned, "configs", [config])
        monkeypatch.setattr(tuned, "cache", {})
    V = 2 * 16384 + 1000
    T = kernels.FEW_ROWS_WAVES * kernels.sm_count(torch.device(DEVICE)) // 3 + 1  # one program per row (no split)
    logits = (torch.randn(3, T, V) * 3).to(dtype)
    assert kernels.vocab_splits(3 * T, V, logits.device)[0] == 1
    logits[0, 1, 5000:9000] = float("-inf")
    labels = torch.randint(0, V, (3, T))
    labels[0, 0] = V - 1
    labels[0, 1] = 42  # a finite logit: the row's -inf ones get p = 0 and gradient 0
    _check_against_reference(ops.logprobs, logits, labels, atol, temperature=0.8)


def test_vocab_splits():
    """Few rows: each row's vocab over several programs, tile-aligned, every column covered once."""
    for n, V in [(1, 151936), (7, 151936), (100, 50257), (3, 16385), (2, 8191 * 2 + 3)]:
        splits, chunk = kernels.vocab_splits(n, V, torch.device("cpu"))
        assert splits * chunk >= V and (splits - 1) * chunk < V, (n, V)
        if splits > 1:
            assert chunk % kernels.fixed_config(V)["BLOCK_V"] == 0 and chunk >= kernels.SPLIT_MIN_V // 2
        else:
            assert chunk == V
    assert kernels.vocab_splits(8, 151936, torch.device("cpu")) == (1, 151936)  # 4 rows per SM x 2 "SMs"
    assert kernels.vocab_splits(1, 151936, torch.device("cpu"))[0] == 8
    assert kernels.vocab_splits(1, 10000, torch.device("cpu")) == (1, 10000)  # too narrow to split


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)])
def test_few_rows_split_vocab(triton_backend, monkeypatch, dtype, atol):
    """Fewer rows than the GPU has programs to fill (here the interpreter's 2 "SMs" x 4): each row's
    vocab is split over 3 programs whose (max, sum, entropy sum) a combine pass merges; the backward
    splits the same way. A split that is all -inf, labels in the first and last split, the in-place
    backward, a non-contiguous view, K labels."""
    V = 3 * 8192 + 77
    assert kernels.vocab_splits(2, V, torch.device("cpu")) == (3, 12288)
    full = (torch.randn(1, 3, V) * 3).to(dtype)
    full[0, 0, 12288:24576] = float("-inf")  # the whole second split of row 0
    view = full[:, :2]  # rows of a longer sequence: not contiguous
    labels = torch.tensor([[3, V - 1]])
    logp, ent, dx = _check_against_reference(ops.logprobs, view, labels, atol, temperature=0.7)
    x = view.clone().requires_grad_()
    lp = ops.logprobs(x * 1.0, labels, temperature=0.7, inplace_backward=True)
    g = torch.randn(1, 2)
    (d_inplace,) = torch.autograd.grad(lp, x, g)
    expected = _fwd_bwd(ops.logprobs, view, labels, g, torch.zeros(1, 2), temperature=0.7)[2]
    torch.testing.assert_close(d_inplace, expected, rtol=0, atol=0)
    topk, g_logp, g_ent = torch.randint(0, 12288, (1, 2, 3)), torch.randn(1, 2, 3), torch.randn(1, 2)  # finite
    out = _fwd_bwd(ops.logprobs, view, topk, g_logp, g_ent)
    r64 = _fwd_bwd(ref.logprobs, view.double(), topk, g_logp, g_ent)
    same = _fwd_bwd(ref.logprobs, view, topk, g_logp, g_ent)
    for name, o, r, sd in zip(("logp", "entropy", "d_logits"), out, r64, same):
        assert_close_to_ref(o, r, sd, atol=atol, name=f"K labels {name}")


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rows", [2, 9], ids=["few-rows-split", "row-per-program"])
def test_vocab_not_a_multiple_of_16(backend, dtype, atol, rows):
    """V = 50257 (GPT-2): most rows start off a 16-byte boundary, so the kernels read (and write) each
    row's aligned middle in 128-bit accesses and its ragged ends column by column. Labels in the
    ragged head, at the first aligned column and in the last column; contiguous logits, a
    non-contiguous view (other row offsets, and d(logits) in another layout), the in-place backward."""
    V = 50257
    full = (torch.randn(1, rows + 1, V) * 3).to(dtype)
    align = 16 // full.element_size()
    labels = torch.randint(0, V, (1, rows))
    for r in range(rows):
        first_aligned = -r * V % align  # the first 16-byte aligned column of contiguous row r
        labels[0, r] = [max(first_aligned - 1, 0), first_aligned, V - 1][r % 3]
    for logits in (full[:, :rows].contiguous(), full[:, 1:]):
        _, _, dx = _check_against_reference(ops.logprobs, logits, labels, atol, temperature=0.9)
        x = logits.clone().requires_grad_()
        g = torch.randn(1, rows)
        lp = ops.logprobs(x * 1.0, labels, temperature=0.9, inplace_backward=True)
        (d_inplace,) = torch.autograd.grad(lp, x, g)
        expected = _fwd_bwd(ops.logprobs, logits, labels, g, torch.zeros(1, rows), temperature=0.9)[2]
        torch.testing.assert_close(d_inplace, expected, rtol=0, atol=0)


def _odd_layouts(rows, V, dtype):
    """[1, rows, V] logits whose rows start at odd element offsets: contiguous (row r at r V), the
    view full[:, 1:] (its data pointer itself off a 16-byte boundary) and rows V + 3 apart."""
    full = (torch.randn(1, rows + 1, V) * 3).to(dtype)
    flat = (torch.randn(1 + rows * (V + 3)) * 3).to(dtype)
    return {"contiguous": full[:, :rows].contiguous(), "offset view": full[:, 1:],
            "row stride V + 3": flat[1:].as_strided((1, rows, V), (rows * (V + 3), V + 3, 1))}


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("V", [5, 301, 1003])
def test_small_odd_vocab_at_odd_offsets(backend, dtype, atol, V):
    """V below one 16-byte group, and odd V with rows at odd element offsets: the aligned middle,
    its masked last tile and the ragged ends together cover each row once (forward, out-of-place
    and in-place backward, K labels); labels at the first, the last and a middle column."""
    rows = 6
    labels = torch.randint(0, V, (1, rows))
    labels[0, :3] = torch.tensor([0, V - 1, V // 2])
    for name, logits in _odd_layouts(rows, V, dtype).items():
        _check_against_reference(ops.logprobs, logits, labels, atol, temperature=0.9)
        g = torch.randn(1, rows)
        expected = _fwd_bwd(ops.logprobs, logits, labels, g, torch.zeros(1, rows), temperature=0.9)[2]
        x = logits.clone().requires_grad_()
        (d_inplace,) = torch.autograd.grad(ops.logprobs(x * 1.0, labels, temperature=0.9, inplace_backward=True),
                                           x, g)
        torch.testing.assert_close(d_inplace, expected, rtol=0, atol=0, msg=f"{name}: in-place backward")
        k_labels = torch.stack([labels, (labels + 1) % V, torch.full_like(labels, V - 1)], -1)
        g_k, g_ent = torch.randn(1, rows, 3), torch.randn(1, rows)
        out = _fwd_bwd(ops.logprobs, logits, k_labels, g_k, g_ent, temperature=0.9)
        r64 = _fwd_bwd(ref.logprobs, logits.double(), k_labels, g_k, g_ent, temperature=0.9)
        same = _fwd_bwd(ref.logprobs, logits, k_labels, g_k, g_ent, temperature=0.9)
        for what, o, r, s in zip(("logp", "entropy", "d_logits"), out, r64, same):
            assert_close_to_ref(o, r, s, atol=atol, name=f"{name}, K labels: {what}")


@pytest.mark.parametrize("case", ["4d-unmergeable-view", "expanded"])
def test_inplace_backward_on_logits_it_cannot_overwrite(backend, case):
    """Logits whose storage cannot take d(logits) get the out-of-place backward, with the same numbers:
    a 4-d view whose leading dims do not merge (as_3d copies it) and expanded logits (positions share
    memory). Before, the first wrote d(logits) into as_3d's copy and handed autograd the logits."""
    torch.manual_seed(0)
    if case == "4d-unmergeable-view":
        leaf = torch.randn(3, 4, 5, 7, dtype=torch.float64, requires_grad=True)
        make = lambda: (leaf * 1.0)[:, :-1]  # noqa: E731
        labels = torch.randint(0, 7, (3, 3, 5))
    else:
        leaf = torch.randn(1, 3, 5, dtype=torch.float64, requires_grad=True)
        make = lambda: (leaf * 1.0).expand(4, 3, 5)  # noqa: E731
        labels = torch.randint(0, 5, (4, 3))
    assert not writable_in_place(make())
    g = torch.randn(labels.shape, dtype=torch.float64)
    (want,) = torch.autograd.grad(ref.logprobs(make(), labels), leaf, g)
    out_of_place, in_place = (torch.autograd.grad(ops.logprobs(make(), labels, inplace_backward=inplace), leaf, g)[0]
                              for inplace in (False, True))
    assert torch.equal(in_place, out_of_place)
    torch.testing.assert_close(out_of_place, want, rtol=0, atol=1e-6)  # the Triton path computes in fp32
