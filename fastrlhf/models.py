"""Causal LMs, the shared actor-critic, the reward model, and checkpoints.

- `load_causal_lm(name_or_path)`: a local Hugging Face directory (model + tokenizer), or a
  built-in config with random weights (`tiny`: the embedded default; `qwen2-0.5b`,
  `llama-0.5b`: 0.5B-class models for GPU timing runs).
- `ActorCritic`: a scalar value head on the policy's own trunk: one forward gives the
  final hidden states (-> log-probs through the lm_head weight) and the values. With LoRA
  the reference policy is the same model with the adapter disabled; with full fine-tuning
  it is a frozen copy.
- `RewardModel`: the trunk of a causal LM plus a scalar head read at the last attended token.
- Checkpoints: trainable weights (safetensors), optimizer, RNG state and step, written to a
  temporary folder and moved into place with `os.replace`, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastrlhf.data import build_char_tokenizer, ensure_pad_token

log = logging.getLogger("fastrlhf")

VALUE_HEAD_FILE = "value_head.safetensors"
SCORE_HEAD_FILE = "score_head.safetensors"
SMALL_MODEL_PARAMS = 20_000_000  # below this, CPU runs use one intra-op thread (see load_causal_lm)


# ---------------------------------------------------------------- device, precision, attention


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing on CPU (the tiny default trains in float32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def attention_backend(device: torch.device) -> str:
    """`flash_attention_2` when flash_attn is importable on CUDA, else PyTorch `sdpa`
    (whose CUDA flash backend is FlashAttention-2)."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def resolve_dtype(name: str, device: torch.device, *, lora: bool) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if (device.type == "cuda" and lora) else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be 'auto' or one of {list(dtypes)}, got {name!r}")
    return dtypes[name]


# ---------------------------------------------------------------- loading


def _tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                       tie_word_embeddings=False)


def _qwen2_05b_config(vocab_size: int):
    """Qwen2-0.5B's shapes with random weights, for GPU timing runs. The real vocabulary
    (151936, tied embeddings) is kept whatever `vocab_size` the tokenizer has: the lm_head and
    log-prob cost is what such a run measures; sampled ids past the tokenizer decode as unknown."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, tie_word_embeddings=True)


def _llama_05b_config(vocab_size: int):
    """A 0.5B Llama (vocab 32000 kept whatever `vocab_size` is, as `_qwen2_05b_config`)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                       tie_word_embeddings=False)


BUILTIN_MODELS = {"tiny": _tiny_config, "qwen2-0.5b": _qwen2_05b_config, "llama-0.5b": _llama_05b_config}


def load_causal_lm(name_or_path: str, *, device: torch.device, dtype: torch.dtype = torch.float32,
                   gradient_checkpointing: bool = False):
    """(model, tokenizer) from a local HF directory or a built-in config name (random weights,
    the embedded char tokenizer). The tokenizer always has a pad token (EOS, with a warning)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    attn = attention_backend(device)
    path = Path(str(name_or_path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json (not a Hugging Face model)")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)
    elif str(name_or_path) in BUILTIN_MODELS:
        tokenizer = build_char_tokenizer()
        config = BUILTIN_MODELS[str(name_or_path)](len(tokenizer))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    else:
        raise ValueError(f"model {str(name_or_path)!r}: no such directory, and not a built-in config "
                         f"({', '.join(BUILTIN_MODELS)})")
    ensure_pad_token(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n = sum(p.numel() for p in model.parameters())
    if device.type == "cpu" and n < SMALL_MODEL_PARAMS and "OMP_NUM_THREADS" not in os.environ:
        # Kernels this small cost more in thread hand-offs than they gain (measured: the
        # default PPO stage runs ~3x faster on one thread of a busy 2-core machine).
        torch.set_num_threads(1)
    log.info("model %s: %.2fM parameters, attention=%s, dtype=%s, device=%s",
             name_or_path, n / 1e6, attn, dtype, device)
    return model, tokenizer


def unwrap(lm):
    """The plain HF causal LM under a peft wrapper (or `lm` itself)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def trunk(lm) -> nn.Module:
    """The decoder stack of a causal LM (e.g. LlamaModel): gives the final, normed hidden states."""
    base = unwrap(lm)
    return getattr(base, base.base_model_prefix)


def lm_head(lm) -> nn.Linear:
    return unwrap(lm).get_output_embeddings()


def hidden_states(lm, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """[B, T, H] final hidden states; logits would be `hidden @ lm_head.weight.T`."""
    out = trunk(lm)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False)
    return out.last_hidden_state


# ---------------------------------------------------------------- actor-critic


class ActorCritic(nn.Module):
    """Policy and critic on one trunk: `forward` returns (hidden [B,T,H], values [B,T] float32).

    `lora_rank > 0` wraps the LM with peft LoRA on every linear layer (the trainable part), and
    the reference is the same model under `disable_adapter()`; `lora_rank == 0` trains every
    weight and keeps a frozen deep copy as the reference.
    """

    def __init__(self, lm, *, lora_rank: int = 0, lora_alpha: float = 32.0):
        super().__init__()
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        self.lora = lora_rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules="all-linear")
            self.policy = get_peft_model(lm, config)
            self.reference = None
        else:
            self.reference = copy.deepcopy(lm).eval().requires_grad_(False)
            self.policy = lm
        hidden = unwrap(lm).config.hidden_size
        device = lm_head(lm).weight.device
        self.value_head = nn.Linear(hidden, 1, device=device, dtype=torch.float32)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.value_head.bias)

    @property
    def lm_head(self) -> nn.Linear:
        return lm_head(self.policy)

    def forward(self, input_ids, attention_mask, position_ids):
        h = hidden_states(self.policy, input_ids, attention_mask, position_ids)
        values = self.value_head(h.float()).squeeze(-1)
        return h, values

    @torch.no_grad()
    def reference_hidden(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """Hidden states of the reference policy (LoRA disabled, or the frozen copy) and its lm_head."""
        if self.lora:
            with self.policy.disable_adapter():
                return hidden_states(self.policy, input_ids, attention_mask, position_ids)
        return hidden_states(self.reference, input_ids, attention_mask, position_ids)

    def reference_lm_head(self) -> nn.Linear:
        return self.lm_head if self.lora else lm_head(self.reference)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def save_pretrained(self, path: Path, tokenizer) -> None:
        """A plain HF directory (LoRA merged) + the value head, loadable with `--model`."""
        lm = copy.deepcopy(self.policy).merge_and_unload() if self.lora else self.policy
        save_model_dir(lm, tokenizer, path, {VALUE_HEAD_FILE: self.value_head.state_dict()})


# ---------------------------------------------------------------- reward model


class RewardModel(nn.Module):
    """Trunk of a causal LM + a scalar head read at the last attended token of each row."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.head = nn.Linear(hidden, 1, device=lm_head(lm).weight.device, dtype=torch.float32)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """scores [B] float32 at the last position where attention_mask = 1 (right-padded responses)."""
        h = hidden_states(self.lm, input_ids, attention_mask, position_ids)
        cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = torch.where(attention_mask.bool(), cols, -1).max(-1).values.clamp(min=0)
        h_last = h[torch.arange(h.shape[0], device=h.device), last]
        return self.head(h_last.float()).squeeze(-1)

    @torch.no_grad()
    def normalize_(self, mean: float, std: float) -> None:
        """Fold (score - mean) / std into the head, so the scores the stats came from get mean 0, std 1."""
        self.head.weight.div_(std)
        self.head.bias.sub_(mean).div_(std)

    def save_pretrained(self, path: Path, tokenizer) -> None:
        save_model_dir(self.lm, tokenizer, path, {SCORE_HEAD_FILE: self.head.state_dict()})

    @classmethod
    def from_pretrained(cls, path, *, device: torch.device, dtype: torch.dtype = torch.float32):
        path = Path(path)
        if not (path / SCORE_HEAD_FILE).is_file():
            raise ValueError(f"reward model {str(path)!r} has no {SCORE_HEAD_FILE} (written by `fastrlhf rm`)")
        lm, tokenizer = load_causal_lm(path, device=device, dtype=dtype)
        model = cls(lm)
        model.head.load_state_dict(load_file(path / SCORE_HEAD_FILE, device=str(device)))
        return model.eval().requires_grad_(False), tokenizer


# ---------------------------------------------------------------- checkpoints


def _tmp_dir(path: Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _move_into_place(tmp: Path, path: Path) -> None:
    """Atomically publish a finished folder: an existing one is renamed away first, then removed."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model_dir(lm, tokenizer, path: Path, extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """A Hugging Face model directory (+ tokenizer, + extra safetensors files), published atomically."""
    tmp = _tmp_dir(path)
    lm.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for filename, tensors in (extra or {}).items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / filename)
    _move_into_place(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(stage_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer, extra: dict,
                    keep: int = 2) -> Path:
    """stage_dir/checkpoints/step_{step:06d}/ {model.safetensors, optimizer.pt, state.pt}, then
    `latest` (a one-line file) points at it; only the newest `keep` checkpoints stay."""
    root = Path(stage_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = _tmp_dir(final)
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp / "model.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"step": step, "rng": rng_state(), "extra": extra}, tmp / "state.pt")
    _move_into_place(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(stage_dir: Path) -> Path | None:
    pointer = Path(stage_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path, module: nn.Module, optimizer) -> dict:
    """Load weights into `module` (every saved tensor must match a parameter), the optimizer
    state and the RNG state; returns {"step", "extra"}."""
    path = Path(path)
    params = dict(module.named_parameters())
    weights = load_file(path / "model.safetensors")
    unknown = set(weights) - set(params)
    if unknown:
        raise ValueError(f"checkpoint {str(path)!r} holds tensors the model does not have: {sorted(unknown)[:5]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    set_rng_state(state["rng"])
    return {"step": int(state["step"]), "extra": state["extra"]}


def write_json_atomic(path: Path, obj) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def resume_from_checkpoint(stage_dir: Path, module: nn.Module, optimizer, enabled: bool, stage: str):
    """(step, extra) of the stage's latest checkpoint, loaded into `module` and `optimizer`, when
    `enabled` and one exists; None otherwise (a fresh start)."""
    ckpt = latest_checkpoint(stage_dir) if enabled else None
    if ckpt is None:
        return None
    state = load_checkpoint(ckpt, module, optimizer)
    log.info("%s: resumed from %s (step %d)", stage, ckpt, state["step"])
    return state["step"], state["extra"]
