"""bench/experiments/coop_actor_loss.py (an experiment, not the package): its cooperative split-row kernel
against `fastrlhf.kernels.ppo_loss.actor_loss_fwd` (itself tested against reference.py in test_actor_loss.py),
in the interpreter, and its sm_90 PTX (16-byte loads, acquire / release atomics at gpu scope).

With spin_limit 0 every program but the last to arrive at its row streams the row itself and the last
merges the partials (in the interpreter, where programs run one after another, that is so for any limit):
both paths run in each case, and the timeout count is exactly known. On a GPU the same tests run compiled,
and `test_coop_waits_on_the_gpu` runs the real waits. Tiny shapes: V = 300 in chunks of 64 (S = 5, the
last chunk partial)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import poison_outputs, worst

from fastrlhf.kernels.ppo_loss import actor_loss_fwd

pytestmark = pytest.mark.slow  # an experiment's kernel in the interpreter and its PTX

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
EXPERIMENTS = ROOT / "bench" / "experiments"
MODULE = "coop_actor_loss"


def _load():
    """The experiment module, imported by path under its file's name (the compile worker imports it so)."""
    if MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(MODULE, EXPERIMENTS / f"{MODULE}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[MODULE]


coop = _load()
V, CHUNK = 300, 64  # S = 5 programs per row, the last with 44 columns
SEQUENTIAL = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs programs one after another


def _inputs(B, T, dtype, *, view=False):
    """Per-token inputs as ops.ppo_actor_loss hands them to the kernel; labels in the first, a middle and
    the last (partial) chunk, one ignore_index, one masked token. view: logits[:, :-1] (row stride V + 1...)."""
    N = B * T
    full = (torch.randn(B, T + view, V) * 2).to(dtype)
    logits = full[:, :T] if view else full
    labels = torch.randint(0, V, (N,))
    labels[: min(N, 3)] = torch.tensor([5, 2 * CHUNK + 7, V - 3])[: min(N, 3)]
    labels[-1] = -100
    mask = torch.ones(N)
    mask[N // 2] = 0.0
    weight = mask / mask.sum()
    logp_guess = torch.randn(N) - 6.0  # ~ log(1 / 300): ratios on both sides of the clip
    return dict(logits=logits, labels=labels, old_logp=logp_guess + 0.3 * torch.randn(N), advantages=torch.randn(N),
                mask=mask, weight=weight, ref_logp=logp_guess + 0.5 * torch.randn(N), is_weights=None)


FLAGS = dict(temperature=1.0, clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.1, kl_estimator="k3",
             kl_clamp=None, kl_straight_through=False, entropy_coef=0.01, need_grad=True)
CASES = {  # name: (dtype, B, T, changes to FLAGS, logits view, is_weights)
    "fp32-k3-entropy-temp": (torch.float32, 1, 3, dict(temperature=0.7), False, False),
    "bf16-dual-is-view": (torch.bfloat16, 1, 2, dict(dual_clip=3.0), True, True),
    "fp32-k2-straight-no-entropy": (torch.float32, 2, 1, dict(kl_estimator="k2", kl_straight_through=True,
                                                              entropy_coef=0.0), False, False),
    "fp32-abs-clamp-no-kl-ref": (torch.float32, 1, 2, dict(kl_estimator="abs", kl_clamp=0.5, kl_coef=0.0), False,
                                 False),
    "bf16-forward-only": (torch.bfloat16, 1, 3, dict(need_grad=False, temperature=1.3), False, False),
}
# coop vs actor_loss_fwd: the same formulas in another summation order (merge of 5 partials vs 1 tile), so
# fp32 rounding apart: logp, entropy to 2e-6; d(logits) to 1e-6 relative in fp32, and in bf16 one ulp
# (2^-8 relative) of a value whose fp32 pre-image may round either way
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-8), torch.bfloat16: dict(rtol=2**-7, atol=1e-8)}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Outputs and the partials scratch start as NaN: anything read before it is written fails."""
    poison_outputs(monkeypatch, MODULE)


@pytest.fixture(autouse=True)
def on_the_gpu():
    """With CUDA the tensors are made there (the kernels run compiled, the programs concurrently)."""
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
        yield
        torch.set_default_device(None)
    else:
        yield


def _close(got, want, name, **tol):
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN pattern differs"
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok].float(), want[ok].float(), **tol,
                               msg=lambda m: f"{name}: {m}\n{worst(got[ok], want[ok])}")


def _run_case(case, spin_limit, tile=None):
    """(coop outputs, actor_loss_fwd outputs, timeouts, S) for one case; `tile` < CHUNK: the REREAD variant."""
    dtype, B, T, changes, view, is_w = CASES[case]
    inputs = _inputs(B, T, dtype, view=view)
    if is_w:
        inputs["is_weights"] = torch.rand(B * T) + 0.5
    flags = FLAGS | changes
    want = actor_loss_fwd(*inputs.values(), **coop.spec_kwargs(flags))
    timeouts = torch.zeros(1, dtype=torch.int32)
    got = coop.coop_actor_loss_fwd(*inputs.values(), **flags, chunk=CHUNK, spin_limit=spin_limit, timeouts=timeouts,
                                   tile=tile)
    for name, g, w in zip(("logp", "entropy"), got[:2], want[:2]):
        _close(g, w, name, rtol=0, atol=2e-6)
    assert got[0][-1].item() == 0.0  # ignore_index: logp 0
    if flags["need_grad"]:
        _close(got[2], want[2], "d(logits)", **TOL[dtype])
    else:
        assert got[2] is None
    return timeouts.item(), B * T, -(-V // CHUNK), flags["need_grad"]


@pytest.mark.parametrize("tile", [None, CHUNK // 4], ids=["registers", "reread"])
@pytest.mark.parametrize("case", CASES)
def test_coop_matches_actor_loss_fwd(case, tile):
    """spin_limit 0: every program but the last to arrive at its row falls back (interpreter and GPU alike),
    so both paths run and, with gradients, the timeout count is exact. The REREAD variant (the chunk in
    tiles, pass 2 re-reading it from memory, the last tile first) gives the same numbers."""
    timeouts, N, S, need_grad = _run_case(case, spin_limit=0, tile=tile)
    if need_grad:
        assert timeouts == N * (S - 1)
    elif SEQUENTIAL:  # only split 0 waits without gradients; in the interpreter it arrives first
        assert timeouts == N
    else:
        assert 0 <= timeouts <= N


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_coop_waits_on_the_gpu(case):
    """The real protocol: concurrent programs wait for their row (default spin limit); the same numbers,
    and never more fallbacks than programs that can wait."""
    timeouts, N, S, need_grad = _run_case(case, spin_limit=coop.SPIN_LIMIT)
    assert 0 <= timeouts <= (N * (S - 1) if need_grad else N)


def test_one_program_per_row_merges_alone():
    """chunk >= V: S = 1, split 0 is the last (only) arrival and takes the cooperative path: no timeout."""
    inputs = _inputs(1, 2, torch.float32)
    want = actor_loss_fwd(*inputs.values(), **coop.spec_kwargs(FLAGS))
    timeouts = torch.zeros(1, dtype=torch.int32)
    got = coop.coop_actor_loss_fwd(*inputs.values(), **FLAGS, chunk=512, spin_limit=0, timeouts=timeouts)
    for name, g, w in zip(("logp", "entropy", "d(logits)"), got, want):
        _close(g, w, name, rtol=1e-5, atol=2e-6)
    assert timeouts.item() == 0


def test_bad_arguments():
    inputs = _inputs(1, 1, torch.float32)
    with pytest.raises(ValueError, match="inplace"):
        coop.coop_actor_loss_fwd(*inputs.values(), **FLAGS, inplace=True)
    with pytest.raises(ValueError, match="power of two"):
        coop.coop_actor_loss_fwd(*inputs.values(), **FLAGS, chunk=96)


# ---------------------------------------------------------------- sm_90 PTX


def _ptx_worker(spec_file: str, out_file: str) -> None:
    """Compile one recorded launch (the JSON spec) to sm_90 and write its PTX; run without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    spec = json.loads(Path(spec_file).read_text())
    fn = getattr(_load(), spec["name"])
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options(dict(spec["options"]))
    src = ASTSource(fn, spec["signature"], constexprs={tuple(p): v for p, v in spec["constexprs"]},
                    attrs={tuple(p): v for p, v in spec["attrs"]})
    kernel = triton.compile(src, target=target, options=options.__dict__)
    assert kernel.asm.get("cubin"), "no cubin"
    Path(out_file).write_text(kernel.asm["ptx"])


def _sm90_ptx(tmp_path, monkeypatch, **launch) -> str:
    """The sm_90 PTX of the launch coop_actor_loss_fwd makes for these arguments (recorded, not run)."""
    from compile_capture import LaunchRecorder
    from triton.backends import backends
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if "nvidia" not in backends:
        pytest.skip("this triton build has no CUDA backend")
    recorder = LaunchRecorder()

    def record_only(self, *args, grid, warmup, **kwargs):
        recorder.record(self.fn, args, kwargs)

    for cls in (InterpretedFunction, JITFunction):
        monkeypatch.setattr(cls, "run", record_only)
    B, T, V_ = launch.pop("shape")
    inputs = _inputs(B, T, torch.float32)
    inputs["logits"] = torch.randn(B, T, V_).to(torch.bfloat16)
    coop.coop_actor_loss_fwd(*inputs.values(), **(FLAGS | launch))
    (spec,) = recorder.specs.values()
    spec_file, out_file = tmp_path / "spec.json", tmp_path / "kernel.ptx"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTRLHF_BACKEND")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))  # helpers, compile_capture
    subprocess.run([sys.executable, __file__, str(spec_file), str(out_file)], env=env, check=True, timeout=300,
                   cwd=TESTS)
    return out_file.read_text()


def test_sm90_ptx_vector_loads_and_ordered_atomics(tmp_path, monkeypatch):
    """bf16 V = 151936 (aligned rows), CHUNK 8192 x 8 warps as on the H100: the chunk loads and the
    d(logits) stores are 16-byte (v4.b32), the arrival is an acq_rel atomic at gpu scope, the polls acquire."""
    ptx = _sm90_ptx(tmp_path, monkeypatch, shape=(2, 3, 151936), chunk=8192, num_warps=8)
    loads = re.findall(r"ld\.global[\w.:]*", ptx)
    stores = re.findall(r"st\.global[\w.:]*", ptx)
    atomics = re.findall(r"atom\.[\w.:]+|ld\.[\w.:]*acquire[\w.:]*", ptx)
    wide_loads = [op for op in loads if op.endswith(".v4.b32")]
    # per thread: 32 bf16 of the chunk = 4 x 16 bytes, once at the start and once more in the fallback
    # loop and its reload of the chunk
    assert len(wide_loads) >= 4, f"chunk loads are not 16-byte: {sorted(set(loads))}"
    assert any(op.endswith(".v4.b32") for op in stores), f"d(logits) stores are not 16-byte: {sorted(set(stores))}"
    assert any(".acq_rel" in a and ".gpu" in a and ".add" in a for a in atomics), atomics
    assert any(".acquire" in a and ".gpu" in a for a in atomics), atomics


if __name__ == "__main__":
    _ptx_worker(*sys.argv[1:3])
