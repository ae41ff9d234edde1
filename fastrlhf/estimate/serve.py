"""`fastrlhf estimate --stage serve`: what serving the tuned policy costs, as vLLM serves it.

A replica is `--gen-tp` GPUs holding the weights (bf16, fp8, int8 or int4; a tensor-parallel share each) and, in
what vLLM's gpu_memory_utilization (0.9) leaves, a paged KV cache (bf16). It decodes up to max_num_seqs (256)
requests at once with continuous batching: a finished request's slot goes to a waiting one, whose prompt is
prefilled in the next steps (chunked prefill). With C requests decoding, a prompt of P tokens and O output tokens:

    step(C)   one decode step: the weights, the C sequences' KV blocks at mean context P + O/2, sampling
              (timing.py: bytes / bandwidth, FLOPs / peak, kernels x gap; vLLM's host work overlaps)
              + tensor parallelism's two all-reduces per layer
    prefill   one prompt's forward (P tokens)
    TPOT(C)   = step(C) + C x prefill / O   (every O steps each of the C slots takes a new prompt)
    TTFT(C)   = prefill + step(C)           (a new request's prefill rides in the next step)
    tokens/s  = C / TPOT(C) per replica;  $ per 1M output tokens = price x GPUs per replica / 3600 / tokens/s x 1e6

At a request rate R per replica the requests in flight are C = R x (TTFT + O x TPOT(C)) (Little's law; solved by
iteration); a replica sustains at most max concurrency / (TTFT + O x TPOT) requests per second, which sets the
GPUs a target rate needs. fp8 weights run W8A8 on GPUs with fp8 tensor cores (H100, H200: twice the bf16 peak),
weight-only elsewhere; int8 / int4 are weight-only (Marlin-style: the weights read at their width, bf16 compute).
Calibrated with the RLHF sources on published vLLM measurements (data/serving_points.json), under the same
leave-one-source-out rule. With --student, the student is served the same way beside the model (its teacher).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import fastrlhf.estimate.timing as T
import fastrlhf.estimate.work as W
from fastrlhf.estimate.arch import Arch
from fastrlhf.estimate.hardware import Device, device
from fastrlhf.estimate.memory import forward_working_bytes, kv_cache_bytes
from fastrlhf.estimate.spec import Spec, actor_arch

# bytes per weight by serving precision (int4: 4 bits + a bf16 scale per group of 128, GPTQ / AWQ layout)
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1, "int4": 0.5 + 2 / 128}
KV_DTYPE = "bf16"  # vLLM's kv_cache_dtype auto: the model's dtype
RATE_ITERATIONS = 60


@dataclass
class Engine:
    """One serving replica's shape: the model, its GPUs and precision, the request lengths."""

    arch: Arch
    dev: Device
    tp: int
    weights: str  # bf16, fp8, int8, int4
    prompt: int
    output: int

    @property
    def weight_bytes(self) -> float:
        return self.arch.params() * WEIGHT_BYTES[self.weights]

    @property
    def peak(self) -> float:
        return self.dev.fp8_flops if self.weights == "fp8" and self.dev.fp8_flops else self.dev.peak_flops

    def kv_per_sequence(self) -> float:
        """KV bytes of one request at its full length, over the replica's GPUs."""
        return kv_cache_bytes(self.arch, sequences=1, length=self.prompt + self.output, dtype=KV_DTYPE)

    def activations(self) -> float:
        return forward_working_bytes(self.arch, tokens=min(W.VLLM_PREFILL_TOKENS, self.prompt * T.VLLM_MAX_NUM_SEQS)
                                     / self.tp, seq=self.prompt, dtype=KV_DTYPE)

    def kv_budget(self) -> float:
        """KV bytes the replica holds: what 0.9 of each GPU leaves after its weight share and a prefill chunk."""
        per_gpu = W.VLLM_MEMORY_UTILIZATION * self.dev.memory_bytes - self.weight_bytes / self.tp - self.activations()
        return max(0.0, per_gpu) * self.tp

    def max_concurrency(self) -> int:
        """Requests decoding at once: as many as the KV cache holds at full length, at most max_num_seqs."""
        return min(T.VLLM_MAX_NUM_SEQS, math.floor(self.kv_budget() / self.kv_per_sequence()))

    def step_work(self, concurrency) -> T.Work:
        work = T.Work("gpu", self.peak, self.dev.bandwidth)
        work.step(**W.vllm_decode_step(self.arch, running=concurrency, context=self.prompt + self.output / 2,
                                       weight_bytes=self.weight_bytes, kv_db=2, db=2, tp=self.tp))
        work.comm += W.tp_allreduce(self.dev, self.arch, concurrency, 2, self.tp)
        return work

    def prefill_work(self) -> T.Work:
        """One prompt's forward (eager: vLLM captures only decode steps in CUDA graphs)."""
        kernels = self.arch.layers * T.VLLM_LAYER_KERNELS
        work = T.Work("gpu", self.peak, self.dev.bandwidth).step(
            flops=W.forward_flops(self.arch, self.prompt, self.prompt / 2, head_tokens=1) / self.tp,
            weight_bytes=self.weight_bytes / self.tp, bytes=W.activation_traffic(self.arch, self.prompt, 2) / self.tp,
            kernels=kernels, ops=kernels, width=self.arch.hidden / self.tp)
        work.comm += W.tp_allreduce(self.dev, self.arch, self.prompt, 2, self.tp)
        return work

    def latency(self, concurrency, f: dict | None = None) -> tuple:
        """(TTFT, TPOT) in seconds at `concurrency` requests decoding (floats, or tensors in the fit)."""
        f = f or T.factors("gpu")
        step, prefill = T.seconds(self.step_work(concurrency), f), T.seconds(self.prefill_work(), f)
        return prefill + step, step + concurrency * prefill / self.output

    def at_rate(self, rate, f: dict | None = None):
        """Requests in flight at `rate` requests per second (Little's law, iterated), capped by what fits."""
        cap = self.max_concurrency()
        concurrency = rate * self.output * self.latency(1, f)[1]
        for _ in range(RATE_ITERATIONS):
            ttft, tpot = self.latency(concurrency, f)
            concurrency = rate * (ttft + (self.output - 1) * tpot)
            if float(concurrency) > cap:
                return cap
        return concurrency


def engine_of(spec: Spec, arch: Arch) -> Engine:
    weights = spec.dtype if spec.serve_weights == "auto" else spec.serve_weights
    return Engine(arch, device(spec.gpu), spec.gen_tp, weights, spec.seq_len, spec.gen_len)


@dataclass
class ServeResult:
    """--stage serve's answer for one replica and, with a request rate, the fleet."""

    engine: Engine
    concurrency: float
    ttft: float
    tpot: float
    rate: float | None  # the requests per second asked for (None: the concurrency given or the most that fits)
    replicas: int

    @property
    def fits(self) -> bool:
        return self.engine.max_concurrency() >= 1

    @property
    def tokens_per_s(self) -> float:
        return self.concurrency / self.tpot

    def to_json(self, spec: Spec) -> dict:
        e = self.engine
        gpus = self.replicas * e.tp
        usd = spec.price * e.tp / 3600 / self.tokens_per_s * 1e6 if spec.price else 0.0
        max_c = e.max_concurrency()
        ttft_max, tpot_max = e.latency(max(1, max_c))
        max_rate = max(1, max_c) / (ttft_max + e.output * tpot_max)
        return {"memory_per_gpu_bytes": {"weights": int(e.weight_bytes / e.tp),
                                         "kv_cache": int(min(e.kv_budget(), max_c * e.kv_per_sequence()) / e.tp),
                                         "activations": int(e.activations())},
                "fits": self.fits, "weights_precision": e.weights, "gpus_per_replica": e.tp,
                "kv_bytes_per_sequence": int(e.kv_per_sequence()), "max_concurrency": max_c,
                "concurrency": float(self.concurrency), "ttft_s": float(self.ttft), "tpot_s": float(self.tpot),
                "tpot_range_s": T.time_range(float(self.tpot), "gpu", "serve"),
                "tokens_per_s_per_replica": float(self.tokens_per_s),
                "max_requests_per_s_per_replica": float(max_rate),
                "request_rate": self.rate, "replicas": self.replicas, "gpus": gpus, "usd_per_1m_output_tokens": usd,
                "decode_terms": T.terms(e.step_work(self.concurrency))}


def serve(spec: Spec, arch: Arch | None = None) -> ServeResult:
    """Serving `arch` (default: --model) as `spec` asks: the concurrency that fits, or the one given, or the
    replicas a request rate needs."""
    e = engine_of(spec, arch or actor_arch(spec))
    cap = e.max_concurrency()
    if cap < 1:
        return ServeResult(e, 0.0, math.inf, math.inf, spec.request_rate, 0)
    if spec.concurrency is not None:
        concurrency, replicas = min(spec.concurrency, cap), 1
    elif spec.request_rate is not None:
        ttft, tpot = e.latency(cap)
        replicas = max(1, math.ceil(spec.request_rate / (cap / (ttft + e.output * tpot))))
        concurrency = e.at_rate(spec.request_rate / replicas)
    else:
        concurrency, replicas = cap, 1
    ttft, tpot = e.latency(max(concurrency, 1))
    return ServeResult(e, concurrency, ttft, tpot, spec.request_rate, replicas)
