"""decode_attention against reference.py in float64 on both backends: grouped-query ratios 1, 2 and 7, L = 1
and 4, written lengths from 0 to T_max mixed in a batch (and below L), prefix groups of 1, 4 and 8 with empty
suffixes and prefixes, strided caches; the same bits for a row whatever the batch; KV work in proportion to
the written slots; the argument checks.

Shapes are the smallest that reach every branch: T_max a little over two splits (kernels.split_size: 128
slots for fp32, 256 for half precision), so a row's splits are full, partial or past its length.
"""

import math

import pytest
import torch
from helpers import assert_close_to_ref, poison_outputs
from torch.utils.flop_counter import FlopCounterMode

from fastrlhf import ops
from fastrlhf import reference as ref
from fastrlhf.kernels import decode_attention as kernels

ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}
FP32_RELATIVE = 2e-6  # fp32: max |out - ref64| <= this times max |ref64|, besides the rule

# (H_q, H_kv, L, D, G): G None = no prefix
CASES = [(2, 1, 1, 16, None), (7, 1, 4, 32, None), (2, 2, 4, 64, 1), (7, 1, 1, 16, 4), (2, 1, 4, 32, 8)]
PARAMS = [(case, dtype) for case in CASES for dtype in (torch.float32, torch.bfloat16)]
PARAMS += [(CASES[1], torch.float16), (CASES[4], torch.float16)]  # the native half-precision dots in the interpreter


@pytest.fixture
def poison(monkeypatch):
    poison_outputs(monkeypatch, "fastrlhf.kernels.decode_attention", "fastrlhf.ops.decode_attention")


def _cache_slots(dtype) -> tuple[int, int]:
    """(T_max, P): a little over two splits of the cache, one and a bit of the prefix."""
    split = kernels.split_size(0, dtype)
    return 2 * split + 44, split + 70


def _lengths(B: int, T: int, L: int, split: int) -> torch.Tensor:
    """Empty, one slot, fewer than L, a split's edge, a full cache, and random lengths, shuffled."""
    fixed = [0, 1, max(L - 1, 2), split, split + 1, T]
    lengths = torch.cat([torch.tensor(fixed[:B]), torch.randint(0, T + 1, (max(B - len(fixed), 0),))])
    return lengths[torch.randperm(B)].to(torch.int32)


def _inputs(case, dtype, B=None):
    H_q, H_kv, L, D, G = case
    B = B or (16 if G == 8 else 8)
    T, P = _cache_slots(dtype)
    split = kernels.split_size(D, dtype)
    q = (torch.randn(B, H_q, L, D) * 1.5).to(dtype)
    k, v = torch.randn(B, H_kv, T, D).to(dtype), torch.randn(B, H_kv, T, D).to(dtype)
    lengths = _lengths(B, T, L, split)
    prefix = None
    if G is not None:
        k_prefix, v_prefix = torch.randn(B // G, H_kv, P, D).to(dtype), torch.randn(B // G, H_kv, P, D).to(dtype)
        prefix_lengths = torch.randint(0, P + 1, (B // G,))
        prefix_lengths[:2] = torch.tensor([P, 0])  # a full prefix and an empty one
        lengths[0] = lengths[G] = 0  # empty suffixes: after a prefix, and after none (nothing to attend)
        prefix = (k_prefix, v_prefix, prefix_lengths, G)
    return q, k, v, lengths, prefix


def _double(prefix):
    return None if prefix is None else (prefix[0].double(), prefix[1].double(), *prefix[2:])


def _id(param) -> str:
    (H_q, H_kv, L, D, G), dtype = param
    return f"Hq{H_q}-Hkv{H_kv}-L{L}-D{D}-{f'G{G}' if G else 'noprefix'}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[_id(p) for p in PARAMS])
def test_matches_reference(backend, poison, case, dtype):
    H_q, H_kv, L, D, G = case
    q, k, v, lengths, prefix = _inputs(case, dtype)
    scale = D**-0.5
    out = ops.decode_attention(q, k, v, lengths, scale=scale, prefix=prefix)
    assert out.shape == q.shape and out.dtype == dtype
    want = ref.decode_attention(q.double(), k.double(), v.double(), lengths, scale=scale, prefix=_double(prefix))
    same = ref.decode_attention(q, k, v, lengths, scale=scale, prefix=prefix)
    assert_close_to_ref(out, want, same, atol=ATOL[dtype], name="out")
    if dtype == torch.float32:
        err = (out.double() - want).abs().max().item()
        assert err <= FP32_RELATIVE * want.abs().max().item(), err
    # rows with nothing written, and queries placed before the first slot, are exactly 0
    P = torch.zeros_like(lengths) if prefix is None else prefix[2].repeat_interleave(G).to(lengths.dtype)
    before = (P + lengths)[:, None] - L + torch.arange(L) < 0  # [B, L]
    assert before.any()
    assert (out.permute(0, 2, 1, 3)[before] == 0).all()


def test_more_queries_than_a_block(backend, poison):
    """H_q / H_kv x L = 72 queries a row, 144 a prefix group: more than a block holds at D = 128 (64), so the
    attention and the merge take 2 blocks a row, the prefix 3 a group, each reading the same tiles."""
    B, H_q, H_kv, L, D, G, T, P = 4, 9, 1, 8, 128, 2, 150, 70
    q, k, v = torch.randn(B, H_q, L, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    lengths = torch.tensor([150, 3, 0, 129], dtype=torch.int32)
    prefix = (torch.randn(B // G, H_kv, P, D), torch.randn(B // G, H_kv, P, D), torch.tensor([70, 5]), G)
    out = ops.decode_attention(q, k, v, lengths, scale=D**-0.5, prefix=prefix)
    want = ref.decode_attention(q.double(), k.double(), v.double(), lengths, scale=D**-0.5, prefix=_double(prefix))
    assert_close_to_ref(out, want, ref.decode_attention(q, k, v, lengths, scale=D**-0.5, prefix=prefix), atol=1e-6)
    assert kernels._blocks(1, H_q // H_kv, L, D)[1] == 2 and kernels._blocks(G, H_q // H_kv, L, D)[1] == 3


def test_strided_caches(backend, poison):
    """Caches laid out [B, T, H_kv, D] and seen as [B, H_kv, T, D], a transposed q, and the prefix a strided
    view of the first row of each group: read through their strides, as the reference reads them."""
    B, H_q, H_kv, L, D, G = 8, 4, 2, 2, 32, 4
    T, P = _cache_slots(torch.float32)
    q = torch.randn(B, L, H_q, D).transpose(1, 2)
    k, v = (torch.randn(B, T, H_kv, D).transpose(1, 2) for _ in range(2))
    full_k, full_v = torch.randn(B, H_kv, P + 7, D), torch.randn(B, H_kv, P + 7, D)
    prefix = (full_k[::G, :, :P], full_v[::G, :, :P], torch.tensor([P, P - 100]), G)
    lengths = _lengths(B, T, L, kernels.split_size(D, torch.float32))
    out = ops.decode_attention(q, k, v, lengths, scale=0.2, prefix=prefix)
    want = ref.decode_attention(q.double(), k.double(), v.double(), lengths, scale=0.2, prefix=_double(prefix))
    assert_close_to_ref(out, want, ref.decode_attention(q, k, v, lengths, scale=0.2, prefix=prefix), atol=1e-6)


def test_hand_worked(backend):
    # keys k0 = (1, 0), k1 = (0, 1) with values (1, 2), (3, 4); scale 1. Row 0 (2 slots, L = 2): query 0 at
    # position 0 sees k0 alone -> (1, 2); query 1 = (0, ln 3) sees both, scores (0, ln 3), weights (1/4, 3/4)
    # -> (2.5, 3.5). Row 1 (1 slot): query 0 at position -1 sees nothing -> 0; query 1 sees k0 -> (1, 2).
    # Row 2: nothing written -> 0.
    ln3 = math.log(3.0)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).expand(3, 1, 2, 2).contiguous()
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).expand(3, 1, 2, 2).contiguous()
    q = torch.tensor([[5.0, -7.0], [0.0, ln3]]).expand(3, 1, 2, 2).contiguous()
    out = ops.decode_attention(q, k, v, torch.tensor([2, 1, 0], dtype=torch.int32), scale=1.0)
    want = torch.tensor([[[1.0, 2.0], [2.5, 3.5]], [[0.0, 0.0], [1.0, 2.0]], [[0.0, 0.0], [0.0, 0.0]]])
    torch.testing.assert_close(out[:, 0], want, rtol=1e-6, atol=1e-6)
    # a shared prefix of one slot, key (1, 0) value (10, 20), before each row's own slot, key (0, 1) value
    # (3, 4); L = 2: query 0 at position 0 sees the prefix -> (10, 20); query 1 sees both, weights (1/4, 3/4)
    # -> (4.75, 8). Row 1 writes nothing of its own: query 0 at position -1 -> 0, query 1 at 0 -> (10, 20).
    prefix = (torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[[10.0, 20.0]]]]), torch.tensor([1]), 2)
    out = ops.decode_attention(q[:2], k[:2, :, 1:], v[:2, :, 1:], torch.tensor([1, 0]), scale=1.0, prefix=prefix)
    want = torch.tensor([[[10.0, 20.0], [4.75, 8.0]], [[0.0, 0.0], [10.0, 20.0]]])
    torch.testing.assert_close(out[:, 0], want, rtol=1e-6, atol=1e-6)


def test_empty(backend):
    q = torch.randn(3, 2, 1, 16)
    empty_cache = torch.randn(3, 1, 0, 16)
    out = ops.decode_attention(q, empty_cache, empty_cache, torch.zeros(3, dtype=torch.int32), scale=0.25)
    assert out.shape == q.shape and (out == 0).all()
    none = ops.decode_attention(q[:0], empty_cache[:0], empty_cache[:0], torch.zeros(0, dtype=torch.int32),
                                scale=0.25)
    assert none.shape == (0, 2, 1, 16)


# ---------------------------------------------------------------- the same numbers whatever the batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [None, 4])
def test_batch_invariant(backend, dtype, G):
    """One row (with a prefix: one group of G rows) alone, and the same data at three positions of a batch of
    16 among rows of other lengths and data: the same output, bit for bit."""
    H_q, H_kv, L, D = 7, 1, 4, 32
    T, P = _cache_slots(dtype)
    B, unit = 16, G or 1
    q = torch.randn(B, H_q, L, D).to(dtype)
    k, v = torch.randn(B, H_kv, T, D).to(dtype), torch.randn(B, H_kv, T, D).to(dtype)
    lengths = torch.randint(1, T + 1, (B,), dtype=torch.int32)
    lengths[:unit] = torch.randint(T // 3, T, (unit,), dtype=torch.int32)  # the tested unit: several splits
    groups = B // unit
    if G:
        prefix_k, prefix_v = torch.randn(groups, H_kv, P, D).to(dtype), torch.randn(groups, H_kv, P, D).to(dtype)
        prefix_lengths = torch.randint(1, P + 1, (groups,))
    positions = [0, groups // 2 + 1, groups - 1]  # in units
    for p in positions[1:]:
        rows = slice(p * unit, (p + 1) * unit)
        q[rows], k[rows], v[rows], lengths[rows] = q[:unit], k[:unit], v[:unit], lengths[:unit]
        if G:
            prefix_k[p], prefix_v[p], prefix_lengths[p] = prefix_k[0], prefix_v[0], prefix_lengths[0]
    assert len(set(lengths.tolist())) > unit + 1  # neighbours of other lengths
    prefix = (prefix_k, prefix_v, prefix_lengths, G) if G else None
    batch = ops.decode_attention(q, k, v, lengths, scale=D**-0.5, prefix=prefix)
    alone_prefix = (prefix_k[:1].clone(), prefix_v[:1].clone(), prefix_lengths[:1].clone(), G) if G else None
    alone = ops.decode_attention(q[:unit].clone(), k[:unit].clone(), v[:unit].clone(), lengths[:unit].clone(),
                                 scale=D**-0.5, prefix=alone_prefix)
    for p in positions:
        got = batch[p * unit:(p + 1) * unit]
        assert torch.equal(got, alone), f"unit at position {p}: max |diff| {(got - alone).abs().max().item():.3e}"


# ---------------------------------------------------------------- work in proportion to the written slots


def _tiles(n: int, split: int) -> int:
    """KV tiles of kernels.BLOCK_N slots that n written slots take, split by split."""
    return sum(math.ceil(min(split, n - s) / kernels.BLOCK_N) for s in range(0, n, split))


def test_kv_tiles_loaded_follow_the_written_length(triton_backend):
    """The kernel's own count of the K / V tiles it loads (kernels.decode_attention_fwd(count_tiles=True)): at
    T_max = 1024 one written slot costs 1/16 of a full cache, every (row, KV head) loads the tiles of its
    written slots only, and a prefix's tiles are loaded once per group of G rows, not per row."""
    B, H_q, H_kv, L, D, T = 4, 4, 2, 1, 16, 1024
    split = kernels.split_size(D, torch.float32)
    q, k, v = torch.randn(B, H_q, L, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    counted = {}
    for t in (1, T):
        lengths = torch.full((B,), t, dtype=torch.int32)
        _, tiles = kernels.decode_attention_fwd(q, k, v, lengths, scale=0.25, count_tiles=True)
        counted[t] = int(tiles.sum())
        assert counted[t] == B * H_kv * _tiles(t, split)
    assert counted[1] * 8 <= counted[T], counted
    lengths = torch.tensor([0, 5, 300, 1024], dtype=torch.int32)
    _, tiles = kernels.decode_attention_fwd(q, k, v, lengths, scale=0.25, count_tiles=True)
    assert int(tiles.sum()) == H_kv * sum(_tiles(n, split) for n in lengths.tolist())
    G, P = 2, 600
    prefix_lengths = torch.tensor([600, 130], dtype=torch.int32)
    prefix = (torch.randn(B // G, H_kv, P, D), torch.randn(B // G, H_kv, P, D), prefix_lengths, G)
    _, tiles = kernels.decode_attention_fwd(q, k, v, lengths, scale=0.25, prefix=prefix, count_tiles=True)
    once_per_group = H_kv * sum(_tiles(p, split) for p in prefix_lengths.tolist())
    assert int(tiles.sum()) == once_per_group + H_kv * sum(_tiles(n, split) for n in lengths.tolist())


def test_torch_path_flops_follow_the_written_length(monkeypatch):
    monkeypatch.setenv("FASTRLHF_BACKEND", "torch")
    B, H_q, H_kv, L, D, T = 4, 4, 2, 1, 16, 1024
    q, k, v = torch.randn(B, H_q, L, D), torch.randn(B, H_kv, T, D), torch.randn(B, H_kv, T, D)
    flops = {}
    for t in (1, T):
        with FlopCounterMode(display=False) as counter:
            ops.decode_attention(q, k, v, torch.full((B,), t, dtype=torch.int32), scale=0.25)
        flops[t] = counter.get_total_flops()
        assert flops[t] == 2 * 2 * B * H_q * L * t * D  # q k^T and p v over the t written slots
    assert flops[1] * 8 <= flops[T], flops


# ---------------------------------------------------------------- argument checks


def _good(**changes):
    B, H_q, H_kv, L, D, T = 4, 4, 2, 1, 16, 32
    args = dict(q=torch.randn(B, H_q, L, D), k_cache=torch.randn(B, H_kv, T, D), v_cache=torch.randn(B, H_kv, T, D),
                lengths=torch.full((B,), 5, dtype=torch.int32), scale=0.25, prefix=None)
    return args | changes


def _prefix(**changes):
    parts = dict(k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16), lengths=torch.tensor([3, 8]), G=2)
    parts |= changes
    return (parts["k"], parts["v"], parts["lengths"], parts["G"])


BAD = [
    (dict(q=torch.randn(4, 4, 16)), ValueError, r"q must be \[B, H_q, L, D\]"),
    (dict(q=torch.randint(0, 3, (4, 4, 1, 16))), TypeError, "q must be a floating-point tensor"),
    (dict(k_cache=torch.randn(4, 2, 32, 16).bfloat16()), TypeError, "k_cache must have q's dtype"),
    (dict(v_cache=torch.randn(4, 2, 31, 16)), ValueError, r"v_cache must have shape k_cache's \[B, H_kv, T, D\]"),
    (dict(k_cache=torch.randn(3, 2, 32, 16)), ValueError, r"k_cache must have shape \[B, H_kv, T, D\]"),
    (dict(k_cache=torch.randn(4, 3, 32, 16), v_cache=torch.randn(4, 3, 32, 16)), ValueError,
     "H_q = 4 must be a multiple of k_cache's heads H_kv = 3"),
    (dict(lengths=torch.full((4,), 5.0)), TypeError, "lengths must be an int32 or int64 tensor"),
    (dict(lengths=torch.full((3,), 5, dtype=torch.int32)), ValueError, r"lengths must have shape \[B\] = \(4,\)"),
    (dict(lengths=torch.tensor([1, 2, 33, 0], dtype=torch.int32)), ValueError,
     r"lengths must lie in \[0, k_cache's T = 32\], got 33"),
    (dict(lengths=torch.tensor([1, -1, 3, 0])), ValueError, "lengths must lie in .* got -1"),
    (dict(scale=0.0), ValueError, "scale must be > 0"),
    (dict(scale=float("nan")), TypeError, "scale must be a finite real number"),
    (dict(prefix=(1, 2)), TypeError, r"prefix must be \(k_prefix, v_prefix, prefix_lengths, G\)"),
    (dict(prefix=_prefix(G=3)), ValueError, "prefix group G = 3 must be >= 1 and divide the batch B = 4"),
    (dict(prefix=_prefix(G=2.0)), TypeError, "prefix group G must be an integer"),
    (dict(prefix=_prefix(k=torch.randn(4, 2, 8, 16))), ValueError, r"k_prefix must have shape \[B / G, H_kv, P, D\]"),
    (dict(prefix=_prefix(v=torch.randn(2, 2, 8, 16).half())), TypeError, "v_prefix must have q's dtype"),
    (dict(prefix=_prefix(lengths=torch.tensor([3, 9]))), ValueError,
     r"prefix_lengths must lie in \[0, k_prefix's P = 8\], got 9"),
    (dict(prefix=_prefix(lengths=torch.tensor([3]))), ValueError, r"prefix_lengths must have shape \[B / G\]"),
    (dict(q=torch.randn(4, 4, 1, 300), k_cache=torch.randn(4, 2, 32, 300), v_cache=torch.randn(4, 2, 32, 300)),
     ValueError, "head dim D = 300 must be at most 256"),
]


@pytest.mark.parametrize("changes,error,match", BAD)
def test_bad_arguments(changes, error, match):
    args = _good(**changes)
    with pytest.raises(error, match=match):
        ops.decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("lengths"), **args)


def test_no_gradient():
    args = _good()
    q = args.pop("q").requires_grad_()
    out = ops.decode_attention(q, args.pop("k_cache").requires_grad_(), args.pop("v_cache"), args.pop("lengths"),
                               **args)
    assert not out.requires_grad


# ---------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
def test_cuda_graph_replay_follows_the_lengths():
    """Captured once, replayed after the lengths (a device tensor) change in place: no host sync, no .item(),
    the grid fixed by the shapes; each replay equals an eager call."""
    torch.manual_seed(0)
    B, H_q, H_kv, L, D, T = 8, 14, 2, 1, 64, 1000
    q = torch.randn(B, H_q, L, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H_kv, T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, H_kv, T, D, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((B,), 3, device="cuda", dtype=torch.int32)
    ops.decode_attention(q, k, v, lengths, scale=0.125)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(q, k, v, lengths, scale=0.125)
    for step in (1, 100, 999):
        lengths.copy_(torch.randint(0, T + 1, (B,), device="cuda"))
        lengths[0] = step
        graph.replay()
        assert torch.equal(out, ops.decode_attention(q, k, v, lengths, scale=0.125))
