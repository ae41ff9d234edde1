"""Scale-out on PyTorch's own engine: torchrun, FSDP2, global batches, rank-0 output.

    torchrun --nproc-per-node 2 -m fastrlhf pipeline                      # one machine, 2 processes
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id RUN -m fastrlhf ppo ...       # the same line on every node

Without torchrun (no WORLD_SIZE in the environment) a stage is one plain process, exactly as
before: every function here is then the identity or a no-op. Under torchrun:

- **Process group**: NCCL on CUDA (rank i on `cuda:LOCAL_RANK`), gloo on CPU. Before a
  model loads, every rank checks that all ranks resolved the same configuration (an
  all-gather of it), so mismatched arguments fail at once instead of hanging later.
- **Sharding** (`--shard`): FSDP2 `fully_shard` on every decoder layer (the model's
  `_no_split_modules`) and on `ShardedModel`, a root around the stage's model that owns the
  rest (embeddings, lm_head, final norm, value/score heads). `full` = ZeRO-3 (parameters,
  gradients and optimizer states sharded; layers resharded after forward), `grad_op` = ZeRO-2
  (layers stay gathered from forward to backward), `none` = replicated (a (world, 1)
  mesh: gradients all-reduced). On CUDA, parameters are gathered in bf16 and gradients
  reduced in fp32. The stage's code runs inside the root's forward (`model.run(fn)`), so the
  fused ops can read the lm_head weight directly, as they do on one process.
- **Global batches**: batch sizes in a configuration are global. Rank 0 draws the global
  batch (the same draw as a single process), every rank takes its contiguous share of it
  (`local_rows`: `split_dataset_by_node`). Losses divide by global counts (`all_sum` of the
  local ones) and are multiplied by the world size (`loss_scale`), since FSDP averages
  gradients over ranks; whitening uses global moments (`ops.raw_moments` of each rank's share,
  summed here by `all_sum`, then `ops.whiten(..., moments=)`). This module only communicates: the
  math is in fastrlhf.ops.
- **Output**: rank 0 alone writes logs, metrics, plots, summaries and the final model; the
  metrics it writes are reduced over ranks (`reduce_metrics`: per-rank time and memory as
  max and mean).
- **The end**: after a normal finish every rank meets the others, destroys the process group
  (`shutdown`) and leaves through `exit_process`: atexit handlers, a flush, `os._exit`, no
  interpreter teardown for gloo's worker threads to abort in.

OUT must be on a file system every node sees (checkpoints are written by all ranks).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from fastrlhf.train.config import RunConfig
from fastrlhf.train.devices import resolve_device

log = logging.getLogger("fastrlhf")

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # set by torchrun
SHARD_MODES = ("full", "grad_op", "none")
PER_RANK_PREFIXES = ("time/", "memory/")  # metrics measured per rank: reported as max (and mean_ as mean)


# ---------------------------------------------------------------- who am I


def launched() -> bool:
    """True when started by torchrun (or anything that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """The number of ranks: from the process group, else from WORLD_SIZE (before it exists), else 1."""
    return dist.get_world_size() if active() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


# ---------------------------------------------------------------- checks before a model loads


def check_launch_env() -> None:
    """Under torchrun every rendezvous variable must be set; a partial set (a hand-made
    launch) is an error naming what is missing, not a wait for ranks that never come."""
    present = [k for k in LAUNCH_ENV if k in os.environ]
    if not present:
        return
    missing = [k for k in LAUNCH_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"distributed launch: {', '.join(missing)} not set (found {', '.join(present)}); start "
                         "every rank with torchrun, e.g. `torchrun --nproc-per-node 2 -m fastrlhf ...`, which sets "
                         f"all of {', '.join(LAUNCH_ENV)}")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if not os.environ[k].isdigit():
            raise ValueError(f"distributed launch: {k}={os.environ[k]!r} must be a non-negative integer")
    if int(os.environ["WORLD_SIZE"]) < 1 or int(os.environ["RANK"]) >= int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"distributed launch: RANK={os.environ['RANK']} must be < WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']}")


def check_shard(mode: str, what: str) -> None:
    if mode not in SHARD_MODES:
        raise ValueError(f"{what}: shard must be one of {', '.join(SHARD_MODES)}, got {mode!r}")


def check_global_batch(what: str, **sizes: int) -> None:
    """Each global batch size divides evenly over the ranks (every rank takes an equal share)."""
    check_launch_env()
    n = world_size()
    for name, value in sizes.items():
        if value % n:
            raise ValueError(f"{what}: {name}={value} is a global batch size and must be divisible by the number "
                             f"of ranks ({n}); pick a multiple of {n} or another --nproc-per-node/--nnodes")


# ---------------------------------------------------------------- process group


def _device(name: str) -> torch.device:
    """The device of this rank: `cuda:LOCAL_RANK` for `auto`/`cuda` when CUDA is there, else the CPU."""
    if name.startswith("cuda:"):
        raise ValueError(f"device={name!r}: under torchrun every rank uses cuda:LOCAL_RANK; pass --device cuda")
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    local = int(os.environ["LOCAL_RANK"])
    if local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local} but this node has {torch.cuda.device_count()} CUDA device(s); start at "
                         "most one process per GPU (--nproc-per-node)")
    return torch.device("cuda", local)


def setup(device_name: str, config: dict, what: str) -> torch.device:
    """The stage's device. Under torchrun, also the process group (once per process; a collective
    that waits longer than `config["dist_timeout_s"]` fails instead of hanging) and the check that
    every rank resolved the same `config`."""
    if not launched():
        return resolve_device(device_name)
    check_launch_env()
    device = _device(device_name)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not active():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=config.get("dist_timeout_s", RunConfig.dist_timeout_s))
        dist.init_process_group(backend, timeout=timeout)
        log.info("distributed: %d ranks, backend %s, this is rank %d", world_size(), backend, rank())
    elif dist.get_backend() != backend:
        raise ValueError(f"{what}: device {device_name!r} needs the {backend} backend, but this process already uses "
                         f"{dist.get_backend()} (every stage of a run must use the same device type)")
    check_same_config(config, what)
    return device


def entry(train: Callable) -> Callable:
    """`train(cfg)`, then, under torchrun, the orderly end of the process group after a normal
    return (an error exits without it: torchrun stops the other ranks)."""

    def run(cfg):
        result = train(cfg)
        shutdown()
        return result

    return run


def shutdown() -> None:
    """Destroy the process group after a run that finished normally (never on an error path,
    where a peer may be gone)."""
    if active():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a process that torchrun started: the atexit handlers (logging's flush among them), then
    `os._exit(code)`, without tearing the interpreter down. One process: `sys.exit(code)`.

    Why: gloo's worker threads (pt_gloo_runloop) outlive `destroy_process_group`, since FSDP2's device
    mesh, which DTensor's caches keep, holds the group. A worker that drops the last reference to a
    tensor with a Python object (its work's inputs and outputs) takes the GIL; once the interpreter
    is finalizing, CPython (3.11 here) ends such a thread with `pthread_exit`, whose unwind through a
    noexcept frame is `std::terminate`: "terminate called without an active exception" and SIGABRT
    after a run that had finished. CI saw that abort on rank 1 of finished 2-rank runs; here a plain
    exit after gloo all-gathers reproduces it, with the backtrace ProcessGroupGloo::runLoop ->
    TensorImpl::decref_pyobject -> PyEval_AcquireThread -> pthread_exit (pytorch/pytorch#190489).
    No thread outlives os._exit."""
    if not launched():
        sys.exit(code)
    atexit._run_exitfuncs()  # what a normal exit runs before it finalizes; the finalization is what is skipped
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}: {x!r} on rank 0, {y!r} here")
    return out


def check_same_config(config: dict, what: str) -> None:
    """Every rank must run the same resolved configuration: an all-gather of it; a rank
    that differs from rank 0 makes every rank fail with the differences listed."""
    if not active():
        return
    text = json.dumps(config, sort_keys=True, default=str)
    texts: list = [None] * world_size()
    dist.all_gather_object(texts, text)
    bad = [r for r, t in enumerate(texts) if t != texts[0]]
    if bad:
        first = json.loads(texts[bad[0]])
        diff = "; ".join(_differences(json.loads(texts[0]), first)[:8])
        raise ValueError(f"{what}: rank(s) {bad} resolved a configuration different from rank 0's (rank {bad[0]}: "
                         f"{diff}); every rank must be started with the same arguments, files and environment")


def all_gather_object(obj) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank (picklable objects); [obj] on one process."""
    if not active():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if active():
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """`with main_first() as main: if main: ...`: rank 0 runs the body (file writes) while the
    others wait; everyone leaves together."""
    yield is_main()
    barrier()


# ---------------------------------------------------------------- collectives


def _as_tensor(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=device, dtype=torch.float64)
    return torch.tensor(x, dtype=torch.float64, device=device)


def _comm_device(x) -> torch.device:
    """Where a collective's tensor must be: the current GPU under NCCL, else the CPU."""
    if isinstance(x, torch.Tensor) and x.device.type == "cuda":
        return x.device
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(x) -> torch.Tensor:
    """The sum over ranks of a number or tensor, as float64 on x's device (x itself, as
    float64, on one process)."""
    t = _as_tensor(x, _comm_device(x))
    if active():
        dist.all_reduce(t)
    return t.to(x.device) if isinstance(x, torch.Tensor) else t


def all_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum over ranks of `x`, as float64 on x's device (x itself on one process)."""
    t = _as_tensor(x, _comm_device(x))
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.to(x.device)


def all_mean(x) -> float:
    """The mean over ranks of a number or 0-d tensor (its value on one process)."""
    return all_sum(x).item() / world_size() if active() else float(x)


def all_finite(x: torch.Tensor) -> bool:
    """Whether `x` is finite on every rank (so a step is skipped on all ranks or on none)."""
    bad = torch.tensor(0.0 if bool(torch.isfinite(x.detach()).all()) else 1.0)
    return all_sum(bad).item() == 0


def draw(pool, n: int) -> list[int]:
    """n ints of `pool` (a list or range) drawn uniformly with replacement with torch's generator,
    rank 0's draw on every rank (all ranks call it with pools of the same length)."""
    values = [pool[i] for i in torch.randint(len(pool), (n,)).tolist()]
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.long, device=_comm_device(None))
    dist.broadcast(t, src=0)
    return t.tolist()


def reduce_metrics(stats: dict[str, float]) -> dict[str, float]:
    """Metrics of this rank -> the metrics rank 0 writes: `time/*` and `memory/*` (measured per
    rank) become the max over ranks, with the mean as `time_mean/*`, `memory_mean/*`; every
    other value is averaged over ranks (each must be global already, or a mean over an equal
    share of the global batch). Every rank must call this with the same keys."""
    if not active():
        return stats
    top, mean = max_and_mean(stats)
    out = {}
    for k in stats:
        if k.startswith(PER_RANK_PREFIXES):
            kind, _, name = k.partition("/")
            out[k], out[f"{kind}_mean/{name}"] = top[k], mean[k]
        else:
            out[k] = mean[k]
    return out


def max_and_mean(values: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(max over ranks, mean over ranks) of per-rank figures (phase seconds, peak bytes)."""
    if not active():
        return dict(values), dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device(None))
    top = t.clone()
    dist.all_reduce(t)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return ({k: top[i].item() for i, k in enumerate(keys)},
            {k: t[i].item() / world_size() for i, k in enumerate(keys)})


# ---------------------------------------------------------------- global batches and moments


def local_rows(table, idx: list[int]) -> dict[str, list]:
    """This rank's share of the global batch `idx` (row numbers of the `datasets.Dataset`
    `table`, the same list on every rank) as {column: list}: the selected rows split by
    `split_dataset_by_node` (contiguous; equal shares when the world size divides len(idx))."""
    from datasets.distributed import split_dataset_by_node

    rows = table.select(idx)
    if active():
        rows = split_dataset_by_node(rows, rank=rank(), world_size=world_size())
    return rows.to_dict()


def loss_scale() -> int:
    """The factor a loss divided by a global count is multiplied by before backward: FSDP
    averages gradients over ranks, and the global loss is the sum of the ranks' parts."""
    return world_size() if active() else 1


def seed_per_rank(seed: int) -> None:
    """Ranks other than 0 reseed with seed + rank, so they sample different responses (call it
    after the model is built: initial weights must be the same on every rank); rank 0 keeps
    the single-process stream."""
    if active() and rank() > 0:
        torch.manual_seed(seed + rank())


# ---------------------------------------------------------------- sharding


class ShardedModel(nn.Module):
    """The root of a stage's model. `model.run(fn)` returns fn(module); under FSDP it runs as
    the root's forward, so the root's parameters (embeddings, lm_head, norm, heads) are
    gathered around it and their gradients reduced after backward, whatever fn reads. On one
    process it is the plain call."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.sharded = False
        self.layer_reshard = True

    def forward(self, fn: Callable[[nn.Module], object]):
        return fn(self.module)

    def run(self, fn: Callable, *args, gathered: bool | nn.Module = False, **kwargs):
        """fn(module, *args, **kwargs). `gathered`: the parameters fn uses are gathered once before
        and freed after, so fn may run any number of forwards, different on each rank (generation,
        evaluation loops); otherwise every rank must run the same forwards (training, scoring).
        True gathers every parameter; a submodule (e.g. the policy, for generation) gathers its
        layers and the root's parameters only, not those of the rest (e.g. a frozen reference).
        What fn returns must not be modified in place (FSDP hooks the backward on it)."""

        def call(module):  # the root's forward gets no tensor arguments (FSDP neither casts nor hooks them)
            return fn(module, *args, **kwargs)

        if not self.sharded:
            return call(self.module)
        if gathered is not False:
            return self._run_gathered(call, None if gathered is True else gathered)
        out = self(call)
        if not any(t.requires_grad for t in _tensors(out)):
            self._reshard()  # nothing to backward: free what stays gathered after a forward
        return out

    def _fsdp_modules(self):
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def _run_gathered(self, fn, within: nn.Module | None):
        inside = None if within is None else {id(m) for m in within.modules()}
        for m in self._fsdp_modules():
            if m is self or inside is None or id(m) in inside:
                m.unshard()
        self.set_reshard_after_forward(False)
        try:
            return self(fn)
        finally:
            self._reshard()

    def _reshard(self) -> None:
        for m in self._fsdp_modules():
            m.reshard()
        self.set_reshard_after_forward(self.layer_reshard)
        self.set_reshard_after_forward(False, recurse=False)  # the root keeps its parameters until backward


def as_sharded(model: nn.Module) -> ShardedModel:
    """`model` if it is a `ShardedModel`, else a plain (unsharded) one around it."""
    return model if isinstance(model, ShardedModel) else ShardedModel(model)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The decoder layers of every Hugging Face model inside `module` (its `_no_split_modules`): the
    units FSDP shards, and what models.compile_layers compiles."""
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"no decoder layers found in {type(module).__name__} (no Hugging Face model with "
                         "_no_split_modules inside it)")
    return layers


def shard_model(module: nn.Module, mode: str, device: torch.device) -> ShardedModel:
    """`module` under a `ShardedModel` root; under torchrun also FSDP2 per decoder layer and
    on the root (module docstring). Build the optimizer after this: the parameters become
    DTensors (this rank's shards)."""
    root = ShardedModel(module)
    if not active():
        return root
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_shard(mode, "shard_model")
    n = world_size()
    if mode == "none":
        mesh = init_device_mesh(device.type, (n, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("shard",))
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    root.layer_reshard = mode == "full"
    layers = decoder_layers(module)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=root.layer_reshard, mp_policy=mp)
    fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    root.sharded = True
    # the stages never change what `run` returns in place (FSDP warns in case a view is returned)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    root.run(lambda m: None)  # the root's forward must come first (FSDP's lazy init picks the root)
    log.info("distributed: %s sharded over %d ranks (--shard %s; %d decoder layers + root)%s",
             type(module).__name__, n, mode, len(layers),
             ", bf16 parameters, fp32 gradient reduction" if device.type == "cuda" else "")
    return root


def gradient_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm from `clip_grad_norm_` as a plain tensor (a DTensor under FSDP)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def quant_stats(param) -> list[torch.Tensor]:
    """The tensors of an NF4 weight's quantisation state (absmax, code book; double-quantised: theirs too);
    [] for any other parameter."""
    qs = getattr(param, "quant_state", None)
    if qs is None:
        return []
    return [qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code] if qs.nested else [])


def state_bytes(module: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds for the parameters, gradients and optimizer states of `module`
    (its shards under FSDP, padding included: the storage sizes)."""

    def nbytes(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(module.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    stats = [t for p in params for t in quant_stats(p)]  # an NF4 weight's absmax and code books
    return {"params": nbytes(params + stats), "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": nbytes(states)}


def state_bytes_summary(module: nn.Module, optimizer, held: dict[str, int] | None = None) -> dict[str, dict[str, int]]:
    """`state_bytes` for a stage's summary: {"state_bytes": max over ranks} and, under torchrun,
    {"state_bytes_mean": mean over ranks}. `held`: this rank's `state_bytes` taken earlier (PPO's,
    after an update, before it frees the gradients); None: taken now."""
    top, mean = max_and_mean(held if held is not None else state_bytes(module, optimizer))
    out = {"state_bytes": {k: int(v) for k, v in top.items()}}
    if active():
        out["state_bytes_mean"] = {k: float(v) for k, v in mean.items()}
    return out


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on the CPU of rank 0 (an all-gather every rank joins; the others
    get {}). On one process: the module's own state dict."""
    if not active():
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export(module: nn.Module, build: Callable[[], nn.Module], save: Callable[[nn.Module], None]) -> None:
    """Write a final model once. One process: save(module). Sharded: every rank joins the
    gather of the full state dict; rank 0 loads it into `build()` (a plain copy built on the
    meta device, its tensors assigned from the state dict) and saves that."""
    if not active():
        save(module)
        return
    state = full_state_dict(module)
    if is_main():
        with torch.device("meta"):
            plain = build()
        plain.load_state_dict(state, assign=True)
        for m in plain.modules():
            if hasattr(m, "tie_weights") and getattr(getattr(m, "config", None), "tie_word_embeddings", False):
                m.tie_weights()  # assign=True replaced the tied tensors one by one
        save(plain)
    barrier()
