"""Compile, for real GPUs, the Triton kernel launches that run here in the interpreter.

Under TRITON_INTERPRET=1 a kernel body runs as Python, so code the Triton compiler rejects
(a Python float where a constexpr is needed, a loop-carried value that changes type, a call
the language lacks) passes every CPU test. This module closes that gap without a GPU:

1. `record_launches()` records every `kernel[grid](...)` launch and turns it at once into
   what `JITFunction.run` would hand the compiler: signature, constexprs, divisibility
   attributes (triton's own binder, so its specialisation rules, e.g. ints equal to 1 and
   16-byte alignment, are the real ones) and the launch options (num_warps, num_stages).
2. `compile_all()` compiles each distinct launch to cubin for the given CUDA targets in
   worker processes where TRITON_INTERPRET is unset, so the kernels are imported as real
   `JITFunction`s, helper `@triton.jit` functions included; ptxas runs as for a launch.

The worker entry point is `python compile_capture.py JOBS_JSON OUT_JSON`.
Binding uses two triton internals, `create_function_from_signature` and `JITFunction._pack_args`
(the same in triton 3.6 and 3.9); if a later triton changes them, recording fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

SPEC_TARGET = ("cuda", 90, 32)  # the backend whose binder specialises the launch arguments


def _jsonable(value, what: str):
    try:
        json.dumps(value)
    except TypeError as e:
        raise TypeError(f"{what} = {value!r} cannot be sent to the compile worker: {e}") from None
    return value


class LaunchRecorder:
    """Collects one spec per distinct (kernel, signature, constexprs, attributes, options)."""

    def __init__(self):
        self.backend = make_backend(GPUTarget(*SPEC_TARGET))
        self.specs: dict[str, dict] = {}
        self.launch_count = 0
        self._binders = {}

    def _binder(self, fn):
        """A real JITFunction of the kernel's Python function (binding needs no compiler)."""
        if fn not in self._binders:
            jf = JITFunction(fn)
            self._binders[fn] = (jf, create_function_from_signature(jf.signature, jf.params, self.backend))
        return self._binders[fn]

    def record(self, fn, args, kwargs):
        jf, binder = self._binder(fn)
        bound_args, specialization, _ = binder(*args, **kwargs)
        _, signature, constexprs, attrs = jf._pack_args(self.backend, dict(kwargs), bound_args, specialization, {})
        name = f"{fn.__module__}.{fn.__qualname__}"
        options = {k: _jsonable(v, f"{name} option {k}") for k, v in kwargs.items() if k not in jf.arg_names}
        spec = {
            "module": fn.__module__,
            "name": fn.__qualname__,
            "signature": signature,
            "constexprs": [[list(path), _jsonable(v, f"{name} constexpr {path}")] for path, v in constexprs.items()],
            "attrs": [[list(path), v] for path, v in attrs.items()],
            "options": options,
        }
        self.specs.setdefault(json.dumps(spec, sort_keys=True), spec)
        self.launch_count += 1


@contextlib.contextmanager
def record_launches():
    """Within the block, every Triton kernel launch (interpreted or compiled) is recorded, then runs."""
    recorder = LaunchRecorder()
    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def recording(original):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                recorder.record(self.fn, args, kwargs)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    for cls, original in originals.items():
        cls.run = recording(original)
    try:
        yield recorder
    finally:
        for cls, original in originals.items():
            cls.run = original


def describe(spec: dict) -> str:
    """One line naming a launch: kernel, non-constexpr signature, constexprs, options."""
    sig = ", ".join(f"{k}: {v}" for k, v in spec["signature"].items() if v != "constexpr")
    names = list(spec["signature"])
    consts = ", ".join(f"{names[p[0]] if len(p) == 1 else p}={v}" for p, v in spec["constexprs"])
    div16 = [names[p[0]] for p, v in spec["attrs"] if v and len(p) == 1]
    return (f"{spec['name']}({sig}) [{consts}] divisible-by-16: {div16 or 'none'} "
            f"options: {spec['options'] or 'defaults'}")


def compile_all(jobs: list[tuple[dict, int]], workers: int | None = None) -> list[dict]:
    """Compile each (spec, CUDA compute capability, e.g. 90) job in worker processes.

    Returns one result per job, in order: {"ok", "error", "ex2"}; `error` is the compiler's message
    when ok is False, `ex2` the `ex2.approx` instruction variants of its PTX.
    """
    if not jobs:
        return []
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTRLHF_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="fastrlhf-compile-") as tmp:
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")  # compile for real, every run
        procs = []
        for w in range(workers):
            shard = [{"index": i, "spec": spec, "target": cc} for i, (spec, cc) in enumerate(jobs)
                     if i % workers == w]
            job_file, out_file = os.path.join(tmp, f"jobs{w}.json"), os.path.join(tmp, f"out{w}.json")
            Path(job_file).write_text(json.dumps(shard))
            proc = subprocess.Popen([sys.executable, __file__, job_file, out_file], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append((proc, out_file))
        results = {}
        for proc, out_file in procs:
            log, _ = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"compile worker exited with {proc.returncode}:\n{log[-4000:]}")
            results.update((r["index"], r) for r in json.loads(Path(out_file).read_text()))
    return [results[i] for i in range(len(jobs))]


def _compile_one(spec: dict, capability: int) -> list[str]:
    """Compiles one launch to cubin; returns the `ex2.approx` variants its PTX uses."""
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    if not isinstance(fn, JITFunction):
        raise TypeError(f"{spec['module']}.{spec['name']} is a {type(fn).__name__}, not a JITFunction "
                        f"(is TRITON_INTERPRET set in the worker?)")
    target = GPUTarget("cuda", capability, 32)
    options = make_backend(target).parse_options(dict(spec["options"]))
    src = ASTSource(fn, spec["signature"],
                    constexprs={tuple(p): v for p, v in spec["constexprs"]},
                    attrs={tuple(p): v for p, v in spec["attrs"]})
    kernel = triton.compile(src, target=target, options=options.__dict__)
    if not kernel.asm.get("cubin"):
        raise RuntimeError("triton.compile returned no cubin")
    return sorted(set(re.findall(r"\bex2\.approx[.\w]*", kernel.asm["ptx"])))


def _worker(job_file: str, out_file: str) -> None:
    results = []
    for job in json.loads(Path(job_file).read_text()):
        try:
            ex2 = _compile_one(job["spec"], job["target"])
            results.append({"index": job["index"], "ok": True, "error": "", "ex2": ex2})
        except Exception as e:  # noqa: BLE001 - every compiler error is a result to report
            message = "".join(traceback.format_exception_only(type(e), e))
            results.append({"index": job["index"], "ok": False, "error": message[-3000:], "ex2": []})
    Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    if "TRITON_INTERPRET" in os.environ:
        sys.exit("compile_capture worker: unset TRITON_INTERPRET, the kernels must be real JITFunctions")
    _worker(*sys.argv[1:3])
