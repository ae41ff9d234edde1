"""One call path for every op (quack's `_torch_library_op.py`, Liger's `autograd.Function`s):

    public function   metadata-only checks, then `op(*inputs, grad=...)`
    eager             a plain `torch.autograd.Function` whose forward and backward call the op's bodies
                      (the launchers or the torch path) directly; without grad the forward body alone
    compiling, or a fake / functional / subclass tensor
                      the registered `fastrlhf::` custom op (fake impl, registered autograd), so that
                      torch.compile(fullgraph=True) sees one node per kernel and opcheck keeps working

A `torch.library.custom_op` costs 7-10 us per call through the dispatcher, and with `register_autograd`
a forward + backward pair about 20 us more than the same bodies under an `autograd.Function`
(docs/ops.md, "Host time"); eager calls pay neither. Both paths run the same bodies, so they give the
same numbers. Imports nothing of the ops (they import it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def eager(x: torch.Tensor) -> bool:
    """True when a call on `x` (the op's main input) may bypass the dispatcher: not under torch.compile
    (Dynamo folds this to False while tracing), and `x` a plain tensor: no FakeTensor, FunctionalTensor,
    DTensor or other subclass, no functorch (vmap / grad) wrapper."""
    return not torch.compiler.is_compiling() and type(x) is torch.Tensor and not _is_wrapped(x)


def register(name: str, forward: Callable, fake: Callable, *, setup_context: Callable | None = None,
             backward: Callable | None = None, mutates_args=()) -> Callable:
    """Register `forward` as the custom op `fastrlhf::<name>` (its fake impl and, given `backward`, its
    autograd), and return `call(*inputs, grad)` for the public function:

        compiling, or inputs[0] not a plain tensor -> the custom op (its registered autograd)
        eager with grad                            -> an autograd.Function around forward / backward
        eager without grad                         -> forward(*inputs)

    `setup_context(ctx, inputs, output)` and `backward(ctx, *grads)` serve both the custom op and the
    Function (the same ctx API: save_for_backward, needs_input_grad, mark_non_differentiable); the
    Function's ctx also has `eager = True`: only there may a backward overwrite a forward output in place
    (the custom op's outputs are the caller's, and opcheck compares them after a backward)."""
    op = torch.library.custom_op(f"fastrlhf::{name}", forward, mutates_args=mutates_args)
    op.register_fake(fake)
    function = None
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)

        def eager_forward(ctx, *inputs):
            # forward and setup_context in one: an autograd.Function with a separate setup_context binds
            # its arguments through inspect.signature on every apply (tens of microseconds)
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            ctx.eager = True  # the backward may work in place on what the forward handed it (no one else sees it)
            return output

        function = type(f"{name}_function", (torch.autograd.Function,), {
            "forward": staticmethod(eager_forward), "backward": staticmethod(backward)})

    mutated = [i for i, p in enumerate(inspect.signature(forward).parameters) if p in mutates_args]

    def call(*inputs, grad: bool = False):
        if not eager(inputs[0]):
            return op(*inputs)
        if grad and function is not None:
            return function.apply(*inputs)
        out = forward(*inputs)
        for i in mutated:  # as the dispatcher does for a mutating op: autograd then sees the change
            torch.autograd.graph.increment_version(inputs[i])
        return out

    call.op = op
    return call
