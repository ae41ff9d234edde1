"""The two models with a scalar head on a causal LM's trunk.

- `ActorCritic`: a value head on the policy's own trunk: one forward gives the final hidden
  states (-> log-probs through the lm_head weight) and the values. With LoRA the reference
  policy is the same model with the adapter disabled; with full fine-tuning it is a frozen copy.
  Without a value head (critic-free PPO, DPO) it is the policy and its reference.
- `RewardModel`: the trunk of a causal LM plus a score head read at the last attended token.

`with_lora` is the one LoRA wrapping every stage uses; `plain_model` is what a stage saves: the LoRA
merged, into the dequantised base when it is 4-bit (QLoRA), whose adapters `save_trained` also writes
alone, in peft's format, under `adapter/`.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from fastrlhf.train.attention import install as install_attention
from fastrlhf.train.checkpoint import save_model_dir
from fastrlhf.train.models import hidden_states, lm_head, load_causal_lm, merged_full_precision, unwrap

VALUE_HEAD_FILE = "value_head.safetensors"
SCORE_HEAD_FILE = "score_head.safetensors"


def _scalar_head(hidden: int, device) -> nn.Linear:
    """A float32 [hidden -> 1] head, N(0, 1/(hidden+1)) weights and a zero bias."""
    head = nn.Linear(hidden, 1, device=device, dtype=torch.float32)
    nn.init.normal_(head.weight, std=1.0 / (hidden + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return head


def no_adapter_input_cast(model: nn.Module) -> None:
    """Stop peft casting each adapter's input to the adapter's dtype. peft 0.21 keeps LoRA weights in
    fp32 (get_peft_model's `autocast_adapter_dtype` upcasts bf16 adapters) and casts the bf16 input up
    (`LoraLayer._cast_input_dtype`), and autocast casts it back down for the matmul: a round trip per
    adapter call that changes no number (the matmul is bf16 under autocast either way). Turned off
    (the switch `peft.helpers.disable_input_dtype_casting` flips), the fp32 adapter weights stay the
    optimizer's master copy and autocast feeds the matmul their bf16 cast."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False


def is_4bit(lm) -> bool:
    """Whether the causal LM under `lm` was loaded with NF4 block linears (`--qlora`)."""
    return bool(getattr(unwrap(lm), "is_loaded_in_4bit", False))


def with_lora(lm, rank: int, alpha: float):
    """`lm` under peft LoRA adapters on every linear layer but the lm_head (the trainable part)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear")
    # peft itself reads transformers 5's deprecated `is_gradient_checkpointing` (a FutureWarning)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(lm, config)


def plain_model(lm):
    """The trained model as a plain HF causal LM: the LoRA merged (into the dequantised NF4 base with
    --qlora), or `lm` itself without adapters."""
    if is_4bit(lm):
        return merged_full_precision(lm)
    return copy.deepcopy(lm).merge_and_unload() if hasattr(lm, "merge_and_unload") else lm


def save_trained(lm, tokenizer, path: Path, heads: dict | None = None, lineage: dict | None = None) -> None:
    """`plain_model(lm)` as a model directory (+ heads, lineage); with --qlora also the adapters in
    `adapter/` (peft's format, for the 4-bit base they were trained on)."""
    save_model_dir(plain_model(lm), tokenizer, path, heads, lineage, adapter=lm if is_4bit(lm) else None)


class ActorCritic(nn.Module):
    """Policy and critic on one trunk: `forward` returns (hidden [B,T,H], values [B,T] float32),
    values None with `value_head=False`.

    `lora_rank > 0` wraps the LM with peft LoRA on every linear layer (the trainable part), and
    the reference is the same model under `disable_adapter()`; `lora_rank == 0` trains every
    weight and keeps a frozen deep copy as the reference.
    """

    def __init__(self, lm, *, lora_rank: int = 0, lora_alpha: float = 32.0, value_head: bool = True):
        super().__init__()
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        self.lora = lora_rank > 0
        if is_4bit(lm) and not self.lora:
            raise ValueError("a 4-bit (--qlora) model trains LoRA adapters: lora_rank must be > 0")
        if self.lora:
            self.policy = with_lora(lm, lora_rank, lora_alpha)
            if lm_head(lm).weight.device.type == "cuda":  # its forwards run under bf16 autocast (devices.autocast)
                no_adapter_input_cast(self.policy)
            self.reference = None
        else:
            self.reference = copy.deepcopy(lm).eval().requires_grad_(False)
            self.policy = lm
        self.value_head = _scalar_head(unwrap(lm).config.hidden_size, lm_head(lm).weight.device) if value_head else None
        for model in (unwrap(lm), self.reference):  # forwards with the host's attention plan (fastrlhf.train.attention)
            if model is not None:
                install_attention(model)

    @property
    def lm_head(self) -> nn.Linear:
        return lm_head(self.policy)

    def forward(self, input_ids, attention_mask, position_ids, attention: dict | None = None):
        """`attention`: the host's plan of this forward's attention (models.hidden_states)."""
        h = hidden_states(self.policy, input_ids, attention_mask, position_ids, attention)
        values = self.value_head(h.float()).squeeze(-1) if self.value_head is not None else None
        return h, values

    @torch.no_grad()
    def reference_hidden(self, input_ids, attention_mask, position_ids, attention: dict | None = None) -> torch.Tensor:
        """Hidden states of the reference policy (LoRA disabled, or the frozen copy)."""
        if self.lora:
            with self.policy.disable_adapter():
                return hidden_states(self.policy, input_ids, attention_mask, position_ids, attention)
        return hidden_states(self.reference, input_ids, attention_mask, position_ids, attention)

    def reference_lm_head(self) -> nn.Linear:
        return self.lm_head if self.lora else lm_head(self.reference)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def save_pretrained(self, path: Path, tokenizer, lineage: dict | None = None) -> None:
        """A plain HF directory (LoRA merged) + the value head if any, loadable with `--model`."""
        heads = {VALUE_HEAD_FILE: self.value_head.state_dict()} if self.value_head is not None else {}
        save_trained(self.policy, tokenizer, path, heads, lineage)


class RewardModel(nn.Module):
    """Trunk of a causal LM + a scalar head read at the last attended token of each row; `lora_rank > 0`:
    the trunk trains LoRA adapters only (a 4-bit trunk needs them)."""

    def __init__(self, lm, *, lora_rank: int = 0, lora_alpha: float = 32.0):
        super().__init__()
        if is_4bit(lm) and lora_rank <= 0:
            raise ValueError("a 4-bit (--qlora) model trains LoRA adapters: lora_rank must be > 0")
        self.lm = with_lora(lm, lora_rank, lora_alpha) if lora_rank > 0 else lm
        self.head = _scalar_head(unwrap(lm).config.hidden_size, lm_head(lm).weight.device)

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

    def save_pretrained(self, path: Path, tokenizer, lineage: dict | None = None) -> None:
        save_trained(self.lm, tokenizer, path, {SCORE_HEAD_FILE: self.head.state_dict()}, lineage)

    @classmethod
    def from_pretrained(cls, path, *, device: torch.device, dtype: torch.dtype = torch.float32):
        path = Path(path)
        if not (path / SCORE_HEAD_FILE).is_file():
            raise ValueError(f"reward model {str(path)!r} has no {SCORE_HEAD_FILE} (written by `fastrlhf rm`)")
        lm, tokenizer = load_causal_lm(path, device=device, dtype=dtype)
        model = cls(lm)
        model.head.load_state_dict(load_file(path / SCORE_HEAD_FILE, device=str(device)))
        return model.eval().requires_grad_(False), tokenizer
