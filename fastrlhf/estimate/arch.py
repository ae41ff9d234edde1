"""Model shapes: presets, Hugging Face config.json files, the trainer's built-in models, parameter counts.

`resolve_model(x)` takes a preset name (`llama-2-7b`, `opt-1.3b`, ...), a training preset of
`fastrlhf ppo --model` (`tiny`, `qwen2-0.5b`, `llama-0.5b`: read from fastrlhf.train.models, not copied),
a local Hugging Face model directory (its config.json; the parameter count is read from the
safetensors headers when the weights are there), a path to a config.json, a parsed config
dict, or an `Arch`. `parse_params("7.5B")` reads parameter counts written as 7.5e9, 7.5B, 770M.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer, as the numbers in its Hugging Face config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    family: str = "llama"  # llama: RMSNorm + gated SiLU MLP + RoPE; opt: LayerNorm + ReLU MLP + biases
    qkv_bias: bool = False  # Qwen2
    max_positions: int = 2048  # OPT's learned position table
    embed_dim: int = 0  # OPT's word_embed_proj_dim (350m: 512, with project_in / project_out); 0 = hidden
    final_norm: bool = True  # OPT-350m (do_layer_norm_before=False) has none
    source: str = ""
    counted_params: int = 0  # exact count read from a checkpoint's weights (0 = use the formula)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def embed(self) -> int:
        return self.embed_dim or self.hidden

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear in one layer."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "up": (h, i), "down": (i, h)}
        if self.family == "llama":
            shapes["gate"] = (h, i)
        return shapes

    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    def layer_params(self) -> int:
        n = self.layer_linear_params()
        if self.family == "opt":  # every linear has a bias; two LayerNorms with weight + bias
            n += sum(b for _, b in self.linear_shapes().values()) + 4 * self.hidden
        else:
            n += 2 * self.hidden + (self.hidden + 2 * self.kv_dim if self.qkv_bias else 0)
        return n

    def head_params(self) -> int:
        """The lm_head matrix (shared with the embedding when tied)."""
        return self.vocab * self.embed

    def formula_params(self) -> int:
        n = self.layers * self.layer_params() + self.vocab * self.embed  # embedding
        n += 0 if self.tied else self.vocab * self.embed  # lm_head
        if self.embed != self.hidden:  # project_in / project_out
            n += 2 * self.embed * self.hidden
        if self.family == "opt":
            n += (self.max_positions + 2) * self.hidden  # learned positions (+2 offset)
            n += 2 * self.hidden if self.final_norm else 0
        else:
            n += self.hidden if self.final_norm else 0
        return n

    def params(self) -> int:
        return self.counted_params or self.formula_params()

    def matmul_params(self, lm_head: bool = True) -> int:
        """Weights a token multiplies through (2 FLOPs each): every layer's linears (+ lm_head)."""
        n = self.layers * self.layer_linear_params()
        n += 2 * self.embed * self.hidden if self.embed != self.hidden else 0  # OPT-350m's projections
        return n + (self.head_params() if lm_head else 0)


def scaled(arch: Arch, params: int) -> Arch:
    """An Arch with about `params` parameters and the same proportions: hidden (and intermediate,
    in head_dim steps) grows by sqrt(params / own), layers stay. Every size-derived quantity
    (weights, FLOPs, activations, KV cache) then follows the new count; `counted_params` pins
    the total to `params` exactly."""
    ratio = math.sqrt(params / arch.formula_params())
    step = arch.head_dim
    hidden = max(step, round(arch.hidden * ratio / step) * step)
    heads = hidden // arch.head_dim
    kv_heads = max(1, round(arch.kv_heads * heads / arch.heads))
    while heads % kv_heads:
        kv_heads -= 1
    intermediate = max(1, round(arch.intermediate * hidden / arch.hidden))
    embed = round(arch.embed_dim * hidden / arch.hidden) if arch.embed_dim else 0
    out = replace(arch, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, embed_dim=embed,
                  source=f"{arch.source or 'preset'} scaled to {format_params(params)}", counted_params=0)
    # the layer count is kept; the rounding of hidden leaves a few % which the count pins
    return replace(out, counted_params=int(params))


# Numbers from each model's config.json on the Hugging Face Hub (repo named in `source`).
PRESETS = {
    "llama-2-7b": Arch(4096, 32, 32, 32, 11008, 32000, False, max_positions=4096, source="meta-llama/Llama-2-7b-hf"),
    "llama-2-13b": Arch(5120, 40, 40, 40, 13824, 32000, False, max_positions=4096,
                        source="meta-llama/Llama-2-13b-hf"),
    "llama-2-70b": Arch(8192, 80, 64, 8, 28672, 32000, False, max_positions=4096, source="meta-llama/Llama-2-70b-hf"),
    "codellama-34b": Arch(8192, 48, 64, 8, 22016, 32000, False, max_positions=16384,
                          source="codellama/CodeLlama-34b-hf"),
    "llama-3-8b": Arch(4096, 32, 32, 8, 14336, 128256, False, max_positions=8192, source="meta-llama/Meta-Llama-3-8B"),
    "llama-3.1-8b": Arch(4096, 32, 32, 8, 14336, 128256, False, max_positions=131072, source="meta-llama/Llama-3.1-8B"),
    "llama-3.1-70b": Arch(8192, 80, 64, 8, 28672, 128256, False, max_positions=131072,
                          source="meta-llama/Llama-3.1-70B"),
    "qwen2.5-0.5b": Arch(896, 24, 14, 2, 4864, 151936, True, qkv_bias=True, max_positions=32768,
                         source="Qwen/Qwen2.5-0.5B"),
    "qwen2.5-7b": Arch(3584, 28, 28, 4, 18944, 152064, False, qkv_bias=True, max_positions=131072,
                       source="Qwen/Qwen2.5-7B"),
    "opt-350m": Arch(1024, 24, 16, 16, 4096, 50272, True, family="opt", max_positions=2048, embed_dim=512,
                     final_norm=False, source="facebook/opt-350m"),
    "opt-1.3b": Arch(2048, 24, 32, 32, 8192, 50272, True, family="opt", max_positions=2048, source="facebook/opt-1.3b"),
    "opt-6.7b": Arch(4096, 32, 32, 32, 16384, 50272, True, family="opt", max_positions=2048,
                     source="facebook/opt-6.7b"),
    "opt-13b": Arch(5120, 40, 40, 40, 20480, 50272, True, family="opt", max_positions=2048, source="facebook/opt-13b"),
    "opt-30b": Arch(7168, 48, 56, 56, 28672, 50272, True, family="opt", max_positions=2048, source="facebook/opt-30b"),
    "opt-66b": Arch(9216, 64, 72, 72, 36864, 50272, True, family="opt", max_positions=2048, source="facebook/opt-66b"),
}


def arch_from_config(config: dict, source: str = "config.json") -> Arch:
    """An `Arch` from a parsed Hugging Face config.json (llama/mistral/qwen2/opt style)."""
    family = "opt" if config.get("model_type") == "opt" else "llama"
    keys = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "intermediate": "ffn_dim" if family == "opt" else "intermediate_size", "vocab": "vocab_size"}
    missing = [key for key in keys.values() if key not in config]
    if missing:
        raise ValueError(f"model config {source} is missing {', '.join(missing)}")
    values = {name: config[key] for name, key in keys.items()}
    bad = [f"{keys[n]}={v!r}" for n, v in values.items() if not isinstance(v, int) or v <= 0]
    if bad:
        raise ValueError(f"model config {source}: expected positive integers, got {', '.join(bad)}")
    tied_default = family == "opt"
    embed = int(config.get("word_embed_proj_dim") or 0) if family == "opt" else 0
    return Arch(
        kv_heads=int(config.get("num_key_value_heads") or values["heads"]),
        tied=bool(config.get("tie_word_embeddings", tied_default)),
        family=family,
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        max_positions=int(config.get("max_position_embeddings", 2048)),
        embed_dim=embed if embed != values["hidden"] else 0,
        final_norm=bool(config.get("do_layer_norm_before", True)) if family == "opt" else True,
        source=source,
        **values,
    )


def _counted_params(directory: Path) -> int:
    """Exact parameter count from the safetensors headers of a model directory (0 if no weights).
    Tied weights are stored once, as the model counts them."""
    files = sorted(directory.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith(("value_head", "score_head"))]
    if not files:
        return 0
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), framework="np") as weights:
            for name in weights.keys():
                total += math.prod(weights.get_slice(name).get_shape())
    return total


def _builtin(name: str) -> Arch | None:
    """A `fastrlhf ppo --model` built-in config (fastrlhf.train.models.BUILTIN_MODELS), imported on demand."""
    try:
        from fastrlhf.train.models import BUILTIN_MODELS
    except ImportError:
        return None
    if name not in BUILTIN_MODELS:
        return None
    from fastrlhf.train.task import build_char_tokenizer

    config = BUILTIN_MODELS[name](len(build_char_tokenizer())).to_dict()
    return arch_from_config(config, f"fastrlhf built-in {name!r}")


def resolve_model(model) -> Arch:
    """A preset name, a training preset name, a model directory, a config.json path, a parsed config, or an Arch."""
    if isinstance(model, Arch):
        return model
    if isinstance(model, dict):
        return arch_from_config(model, "config dict")
    if not isinstance(model, str):
        raise TypeError("model: expected a preset name, a model directory, a config.json path or a dict, "
                        f"got {type(model).__name__}")
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: directory {path} has no config.json (not a Hugging Face model)")
        arch = _config_file(path / "config.json")
        return replace(arch, source=str(path), counted_params=_counted_params(path))
    if path.suffix == ".json" or path.exists():
        return _config_file(path)
    builtin = _builtin(model)
    if builtin is not None:
        return builtin
    raise ValueError(f"model: unknown preset {model!r}; expected one of {', '.join(PRESETS)}, a `fastrlhf ppo "
                     "--model` built-in (tiny, qwen2-0.5b, llama-0.5b), a model directory or a config.json path")


def _config_file(path: Path) -> Arch:
    if not path.is_file():
        raise ValueError(f"model: config file {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"model: {path} is not valid JSON ({err})") from err
    return arch_from_config(config, str(path))


_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_params(value, name: str = "params") -> int:
    """A parameter count from 7500000000, 7.5e9, '7.5e9', '7.5B', '770M' or '13b'."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a parameter count such as 7.5e9, 7.5B or 770M, got {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", value)
        if not match:
            raise ValueError(f"{name}: expected a parameter count such as 7.5e9, 7.5B or 770M, got {value!r}")
        number = float(match.group(1)) * _SUFFIX[match.group(2).upper()]
    else:
        raise TypeError(f"{name}: expected a parameter count such as 7.5e9, 7.5B or 770M, got {value!r}")
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{name}: expected a positive parameter count, got {value!r}")
    return int(round(number))


def format_params(n: float) -> str:
    """494M, 6.74B, 1.3T; small models in K or M with enough digits to be read."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{int(n)}"
