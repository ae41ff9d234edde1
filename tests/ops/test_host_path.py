"""The eager CUDA path does no torch work besides allocating outputs (issue 23): on CPU tensors forced down
the Triton path (FASTRLHF_BACKEND=triton, the interpreter) with every Triton launch stubbed out
(`fastrlhf.bench.measure.stubbed_launches`), a TorchDispatchMode counts the torch ops each call dispatches.
Allocations (`empty*`) and views (aliasing ops: `view`, `unbind`, `select`, ...) launch no kernel and are
not counted; everything else would be a CUDA kernel launch on a GPU. Host time itself is measured by
bench/host_overhead.py, never asserted here."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastrlhf import ops
from fastrlhf.bench.measure import stubbed_launches

ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class CountOps(TorchDispatchMode):
    """The torch ops dispatched inside the block that are neither an allocation nor a view."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ALLOCATIONS and not _is_view(func):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cuda_path(triton_backend):
    """The kernels' names as they are launched (stubbed)."""
    with stubbed_launches() as launched:
        yield launched


B, T = 4, 33


def _inputs():
    lp = -torch.rand(B, T) * 3
    return {"logp": lp.clone(), "old": lp + 0.1 * torch.randn(B, T), "adv": torch.randn(B, T),
            "mask": torch.rand(B, T) > 0.2}


CASES = {
    "policy_loss": lambda x, i: ops.policy_loss(x, i["old"], i["adv"], i["mask"])[0],
    "policy_loss-seq-mean-token-mean-dual": lambda x, i: ops.policy_loss(x, i["old"], i["adv"], i["mask"],
                                                                        dual_clip=3.0, agg="seq-mean-token-mean")[0],
    "policy_loss-global": lambda x, i: ops.policy_loss(x, i["old"], i["adv"], i["mask"], global_num_tokens=100.0)[0],
    "value_loss": lambda x, i: ops.value_loss(x, i["old"], i["adv"], i["mask"])[0],
    "value_loss-seq-mean-token-sum-norm": lambda x, i: ops.value_loss(x, i["old"], i["adv"], i["mask"],
                                                                      agg="seq-mean-token-sum-norm")[0],
    "token_kl": lambda x, i: ops.token_kl(x, i["old"], estimator="k3"),
}


@pytest.mark.parametrize("name", CASES)
def test_forward_launches_no_torch_op(cuda_path, name):
    inputs = _inputs()
    with torch.no_grad(), CountOps() as counted:
        CASES[name](inputs["logp"], inputs)
    assert counted.ops == [], f"{name} forward dispatched {counted.ops}"
    assert cuda_path, "no kernel launched: the call did not take the Triton path"


@pytest.mark.parametrize("name", CASES)
def test_forward_backward_launches_no_torch_op(cuda_path, name):
    """Forward with autograd and the backward (an explicit upstream gradient: `loss.backward()` would have
    autograd itself make a ones tensor), d(input) of the input's dtype: only the kernels."""
    inputs = _inputs()
    x = inputs["logp"].requires_grad_()
    with CountOps() as counted:
        out = CASES[name](x, inputs)
        torch.autograd.grad(out, x, torch.empty(out.shape))
    assert counted.ops == [], f"{name} forward + backward dispatched {counted.ops}"
    assert cuda_path, "no kernel launched: the call did not take the Triton path"


def test_launches_per_call(cuda_path):
    """policy_loss: the main and the finish kernel forward, one in-place scale backward; token_kl one each."""
    inputs = _inputs()
    x = inputs["logp"].requires_grad_()
    loss = CASES["policy_loss"](x, inputs)
    assert cuda_path == ["_policy_loss_fwd_kernel", "_loss_finish_kernel"]
    torch.autograd.grad(loss, x, torch.empty(()))
    assert cuda_path[2:] == ["_scale_unless_one_kernel"]
    del cuda_path[:]
    kl = CASES["token_kl"](x, inputs)
    torch.autograd.grad(kl, x, torch.empty(kl.shape))
    assert cuda_path == ["_token_kl_fwd_kernel", "_token_kl_bwd_kernel"]


def test_the_counter_sees_torch_ops(cuda_path):
    """The mode does count what a kernel launch would be (the assertions above are not vacuous)."""
    inputs = _inputs()
    with CountOps() as counted:
        (inputs["logp"] * 2).sum()
    assert counted.ops == ["mul", "sum"]
