"""Triton kernels and their host launchers (installed as `fastrlhf.kernels`).

Imports only torch and triton: no autograd, no nn.Module, nothing from the trainer.
Each module is one op family: constants, `@triton.jit` kernels, then launchers.
"""
