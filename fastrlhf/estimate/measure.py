"""`fastrlhf estimate --measure`: predicted vs measured state bytes of a tiny model's training step.

The tiny model is held as this trainer holds its policy: on CPU fp32 weights and AdamW; on CUDA
full fine-tuning keeps fp32 weights under bf16 autocast (fp32 gradients and AdamW states), LoRA a
bf16 base with fp32 adapters (peft upcasts them). Those are the fsdp2 engine's bytes per parameter.
QLoRA (`qlora=True`, bitsandbytes installed): the block linears in NF4 as `fastrlhf sft --qlora` loads
them (fastrlhf.train.models.load_4bit), their weights counted with their quantisation statistics.
"""

from __future__ import annotations

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "tie_word_embeddings": False, "max_position_embeddings": 128}


def _tensor_bytes(tensors) -> int:
    from fastrlhf.train.distributed import quant_stats

    tensors = list(tensors)
    tensors += [q for t in tensors for q in quant_stats(t)]  # an NF4 weight's absmax and code books
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def build_tiny_model(lora_rank: int = 0, config: dict | None = None, dtype=None, qlora: bool = False,
                     device: str = "cpu"):
    """A small transformers LlamaForCausalLM (+ peft LoRA on every linear when lora_rank > 0; its block
    linears in NF4 with `qlora`)."""
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = {k: v for k, v in (config or TINY_LLAMA).items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    if qlora:
        from fastrlhf.train.models import load_4bit

        with tempfile.TemporaryDirectory(prefix="fastrlhf-measure-") as tmp:
            model.save_pretrained(tmp)
            model = load_4bit(tmp, attn="sdpa", device=torch.device(device), dtype=dtype or torch.float32)
    elif dtype is not None:
        model = model.to(dtype)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                 "up": "up_proj", "down": "down_proj"}
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                 target_modules=list(names.values())))
    return model


def measure_states(model, steps: int = 2, batch: int = 2, seq: int = 16) -> dict:
    """Run AdamW steps on random tokens; exact bytes of parameters, gradients, optimizer states."""
    import contextlib

    import torch

    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    vocab = model.config.vocab_size
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep grads so they can be counted
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
    out = {
        "weights": _tensor_bytes(p for p in model.parameters()),
        "gradients": _tensor_bytes(p.grad for p in trainable),
        "optimizer": _tensor_bytes(states),
    }
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def measure(lora_rank: int = 0, device: str | None = None, *, qlora: bool = False, config: dict | None = None) -> dict:
    """Predicted vs measured bytes for one SFT step of the tiny model, or of `config` (fp32 on CPU; the
    trainer's CUDA precision on CUDA; `qlora`: its block linears in NF4)."""
    import torch

    from fastrlhf.estimate.plan import estimate

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bf16" if device == "cuda" else "fp32"
    storage = torch.bfloat16 if (device == "cuda" and lora_rank) else torch.float32
    batch, seq = 2, 16
    config = config or TINY_LLAMA
    if qlora:  # loaded onto its device quantised
        model = build_tiny_model(lora_rank, config, dtype=torch.bfloat16 if device == "cuda" else None, qlora=True,
                                 device=device)
    else:
        model = build_tiny_model(lora_rank, config, dtype=storage).to(device)
    measured = measure_states(model, batch=batch, seq=seq)
    result = estimate(model=config, stage="sft", engine="fsdp2", dtype=dtype, lora_rank=lora_rank, qlora=qlora,
                      micro_batch=batch, seq_len=seq, gen_len=0, logits="materialised", flash_attention=False,
                      gpu="cpu" if device == "cpu" else "h100")
    predicted = result["stages"]["sft"]["memory_per_gpu_bytes"]
    return {"device": device, "dtype": dtype, "lora_rank": lora_rank, "predicted": predicted, "measured": measured}


def _op_counter():
    """A TorchDispatchMode that counts the aten ops dispatched under it (a custom op's own ops included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    return Count()


def count_advantage_ops(advantage: str = "gae", batch: int = 16, lengths: tuple[int, int] = (12, 48)) -> dict:
    """Aten ops the trainer's phase 4 (ppo.with_advantages: KL-shaped rewards, the `advantage` estimator, the
    whitening) dispatches on CPU over [batch, T] responses, counted at two response lengths: {"fixed": the ops
    around the recursion, "per_token": the ops each response token adds}. These are timing.ADV_CPU_OPS and
    timing.GAE_TORCH_OPS_PER_TOKEN."""
    import types

    import torch

    from fastrlhf.train.recipes import ppo

    cfg = ppo.PPOConfig(advantage=advantage, num_generations=1 if advantage == "gae" else 4)
    estimator = ppo.advantage_estimator(cfg)

    def count(T: int) -> int:
        g = torch.Generator().manual_seed(0)
        mask = (torch.rand(batch, T, generator=g) > 0.2).float()
        mask[:, 0] = 1
        logp, ref, values = (torch.randn(batch, T, generator=g) * mask for _ in range(3))
        exp = ppo.Experience(types.SimpleNamespace(response_mask=mask), logp, ref,
                             values if advantage == "gae" else None)
        with torch.no_grad(), _op_counter() as c:
            ppo.with_advantages(exp, torch.randn(batch, generator=g), 0.1, cfg, estimator)
        return c.n

    small, big = (count(T) for T in lengths)
    per_token = (big - small) / (lengths[1] - lengths[0])
    return {"fixed": small - per_token * lengths[0], "per_token": per_token}


def count_layer_ops(lora_rank: int = 0, layers: tuple[int, int] = (2, 4)) -> dict[str, float]:
    """Aten ops one decoder layer dispatches on CPU in fp32 (counted with TorchDispatchMode): its no-grad forward,
    and its forward and backward with gradients; per layer = the difference between two depths of the tiny Llama
    (peft LoRA on every linear when lora_rank > 0), divided by the layers between them. These are the CPU class's
    counts in timing.LAYER_OPS."""
    import torch

    def counts(depth: int) -> tuple[int, int, int]:
        model = build_tiny_model(lora_rank, dict(TINY_LLAMA, num_hidden_layers=depth))
        ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16))
        with torch.no_grad(), _op_counter() as fwd:
            model(input_ids=ids)
        with _op_counter() as train_fwd:
            loss = model(input_ids=ids).logits.float().sum()
        with _op_counter() as bwd:
            loss.backward()
        return fwd.n, train_fwd.n, bwd.n

    small, big = counts(layers[0]), counts(layers[1])
    per = [(b - s) / (layers[1] - layers[0]) for s, b in zip(small, big)]
    return {"forward": per[0], "train_forward": per[1], "backward": per[2]}
