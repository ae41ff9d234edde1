"""Causal LMs: built-in configs, what a model is before its weights load (`ModelSource`:
tokenizer, config, lineage, checked), loading, and the accessors the stages use (trunk,
lm_head, final hidden states).

A model is a local Hugging Face directory (config.json, weights, tokenizer files), or a
built-in config with random weights (`tiny`: the embedded default; `tiny-student`: its distillation
student; `qwen2-0.5b`,
`llama-0.5b`: 0.5B-class models for GPU timing runs) and the built-in task's char tokenizer.
Model directories written by the stages carry `fastrlhf.json`: the model they descend from
(`origin`: a built-in config name, or the resolved path of the user's directory) and the data
they were last trained on (`trained_on`); a reward model also records how its texts were
encoded (`max_prompt_len`, `max_response_len`, `chat_template`). A directory without that file
is its own origin, by its resolved path, whatever its name: only a built-in config, or a model a
stage trained from one, counts as built-in.

QLoRA (`load_causal_lm(..., qlora=True)`, checked first by `check_qlora`): the decoder layers' linears
load in NF4 with double quantisation through transformers' bitsandbytes path (a built-in config is
built as without it, saved to a temporary folder and loaded from there), computing in the load dtype;
embeddings, norms and the lm_head stay unquantised in float32 (peft's prepare_model_for_kbit_training).
`merged_full_precision` turns a LoRA-wrapped 4-bit model back into a plain model: each NF4 weight
dequantised plus its adapter's delta.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastrlhf.train.attention import planned_inputs
from fastrlhf.train.checkpoint import read_json
from fastrlhf.train.data import Encoder, ensure_pad_token
from fastrlhf.train.devices import attention_backend, cpu_threads_for
from fastrlhf.train.distributed import decoder_layers, quant_stats
from fastrlhf.train.task import build_char_tokenizer

log = logging.getLogger("fastrlhf")

LINEAGE_FILE = "fastrlhf.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


# ---------------------------------------------------------------- built-in configs


def _tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                       tie_word_embeddings=False)


def _tiny_student_config(vocab_size: int):
    """A student for `tiny` (the distillation demo, `fastrlhf pipeline --algo distill`): 2 of its 4 layers
    and half its MLP width: 0.29M parameters, 0.34x its 0.87M."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
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


BUILTIN_MODELS = {"tiny": _tiny_config, "tiny-student": _tiny_student_config, "qwen2-0.5b": _qwen2_05b_config,
                  "llama-0.5b": _llama_05b_config}


# ---------------------------------------------------------------- before loading


@dataclasses.dataclass
class ModelSource:
    """A model before its weights load: what the stages check and size things by."""

    spec: str
    """A built-in config name or a model directory."""
    tokenizer: Any
    """Its tokenizer (checked against `config`; it always has a pad token)."""
    config: Any
    """Its transformers config (vocab_size, max_position_embeddings, ...)."""
    origin: str
    """The built-in config name or the user directory (resolved path) the weights descend from."""
    trained_on: str | None = None
    """The data a fastrlhf stage last trained it on (`builtin` or a path); None if not known."""

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def descendant(self, spec, trained_on: str) -> ModelSource:
        """What a stage that trains this model on `trained_on` and saves it at `spec` produces."""
        return dataclasses.replace(self, spec=str(spec), trained_on=trained_on)

    def lineage(self, trained_on: str) -> dict:
        return {"origin": self.origin, "trained_on": trained_on}


# a (prompt, response) that `same_encoding` and `check_tokenizer` encode
PROBE = ("Question: what is two plus two?", " Four.")
FED_SPECIAL_TOKENS = ("pad", "eos")  # the trainer puts these into its batches itself (padding, the EOS appended)


def _template_ids(tokenizer) -> set[int]:
    """The ids a chat template renders around a probe conversation (empty without a template, or
    when it cannot render one: data.Encoder reports that when it is used)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    prompt, response = PROBE
    try:
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": response}], tokenize=True,
                                            return_dict=True)
    except Exception:  # noqa: BLE001 - a template is user code: whatever it raises, Encoder reports it on use
        return set()
    return set(out["input_ids"])


def check_tokenizer(tokenizer, config, where: str) -> None:
    """The tokenizer can end responses (EOS), pads (EOS as pad, with a warning, when it has no
    pad token), and every id the trainer feeds the model indexes its embedding: pad, EOS, the
    chat template's tokens and every token text can encode to. A special token past the embedding
    that none of those is (e.g. the unk token a byte-level BPE never emits, which transformers'
    Qwen2Tokenizer adds) is a warning naming it; data that encodes to it is an error naming the
    row (data.Encoder)."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{where}: the tokenizer has no EOS token (responses end with one); set eos_token")
    ensure_pad_token(tokenizer)
    rows = config.vocab_size
    outside = {token: i for token, i in tokenizer.get_vocab().items() if not 0 <= i < rows}
    if not outside:
        return
    fed = {getattr(tokenizer, f"{name}_token"): f"{name} token" for name in FED_SPECIAL_TOKENS}
    template = _template_ids(tokenizer)
    special = set(tokenizer.all_special_tokens)
    refused = [f"{fed[t]} {t!r} has id {i}" for t, i in outside.items() if t in fed]
    refused += [f"chat template token {t!r} has id {i}" for t, i in outside.items() if t not in fed and i in template]
    textual = sorted(i for t, i in outside.items() if t not in special)
    if refused:
        raise ValueError(f"{where}: the tokenizer's {'; '.join(refused)}, outside the model's embedding "
                         f"(vocab_size {rows}); resize the embeddings (model.resize_token_embeddings(len(tokenizer))) "
                         "and save the model again")
    if textual:
        raise ValueError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                         f"{rows} rows (vocab_size); {len(textual)} tokens that text can encode to have ids from "
                         f"{textual[0]} on, past it; resize the embeddings "
                         "(model.resize_token_embeddings(len(tokenizer))) and save the model again")
    unfed = ", ".join(f"{t!r} (id {i})" for t, i in sorted(outside.items(), key=lambda x: x[1]))
    warnings.warn(f"{where}: the tokenizer's special token(s) {unfed} lie outside the model's embedding "
                  f"(vocab_size {rows}); the trainer never feeds them (not pad, EOS or the chat template's), and "
                  "data that encodes to one is an error naming its row", stacklevel=3)


def model_source(spec, *, where: str = "model") -> ModelSource:
    """Tokenizer, config and lineage of a built-in config name or a model directory, checked
    (files present and parsing, special ids inside the vocabulary), without loading weights."""
    from transformers import AutoConfig, AutoTokenizer

    spec = str(spec)
    path = Path(spec)
    if spec in BUILTIN_MODELS and not path.is_dir():
        tokenizer = build_char_tokenizer()
        source = ModelSource(spec, tokenizer, BUILTIN_MODELS[spec](len(tokenizer)), origin=spec)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{where}: model directory {spec!r} has no config.json (not a Hugging Face model)")
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"{where}: model directory {spec!r} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); save the model's tokenizer there with "
                             "tokenizer.save_pretrained(...)")
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot read {path / 'config.json'} ({e})") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{where}: cannot load the tokenizer of {spec!r} ({str(e).splitlines()[0]})") from None
        lineage_file = path / LINEAGE_FILE
        fix = "fastrlhf wrote it with the model: restore it, or delete it (the model then has no recorded lineage)"
        lineage = read_json(lineage_file, fix=fix) if lineage_file.is_file() else {}
        source = ModelSource(spec, tokenizer, config, origin=lineage.get("origin", str(path.resolve())),
                             trained_on=lineage.get("trained_on"))
    else:
        raise ValueError(f"{where}: model {spec!r}: no such directory, and not a built-in config "
                         f"({', '.join(BUILTIN_MODELS)})")
    check_tokenizer(source.tokenizer, source.config, f"{where} {spec!r}")
    return source


def same_encoding(a: Encoder, b: Encoder, probe: tuple[str, str] = PROBE) -> bool:
    """Whether two Encoders turn a (prompt, response) into the same ids: the same vocabulary and
    special ids, and the same tokens for `probe` (so the same chat template or none, the same
    BOS/EOS rule). A template that cannot render the probe counts as different."""
    ta, tb = a.tokenizer, b.tokenizer
    ids = ("pad_token_id", "eos_token_id", "bos_token_id")
    if ta.get_vocab() != tb.get_vocab() or any(getattr(ta, i) != getattr(tb, i) for i in ids):
        return False
    prompt, response = probe
    try:
        pa, pb = a.prompts([prompt]), b.prompts([prompt])
        return pa == pb and (a.responses([prompt], pa, [response], warn_empty=False)
                             == b.responses([prompt], pb, [response], warn_empty=False))
    except ValueError:  # a chat template that renders the prompt differently alone and with an answer
        return False


# ---------------------------------------------------------------- loading


QLORA_INSTALL = 'pip install "fastrlhf[qlora]"'


def quantisable_linears(config) -> int:
    """How many linears of the decoder layers transformers' bitsandbytes path turns into NF4 (plain
    nn.Linear and GPT-2's Conv1D), counted on a copy built on the meta device."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(1 for layer in decoder_layers(model) for m in layer.modules()
               if type(m) is nn.Linear or isinstance(m, Conv1D))


def check_qlora(source: ModelSource, lora_rank: int, where: str, key_prefix: str = "") -> None:
    """`--qlora`'s refusals, before any weights load: bitsandbytes missing, no LoRA adapters to train,
    one process only, a model already quantised or whose decoder layers hold no linear to quantise."""
    flag = f"--{key_prefix}qlora"
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"{where}: {flag} needs bitsandbytes, which is not installed: {QLORA_INSTALL}")
    if lora_rank <= 0:
        raise ValueError(f"{where}: {flag} trains LoRA adapters on a frozen 4-bit base: --{key_prefix}lora_rank "
                         f"must be > 0 (e.g. 16), got {lora_rank}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"{where}: {flag} runs in one process; FSDP2 does not shard bitsandbytes' NF4 weights "
                         "(run without torchrun, or without --qlora)")
    family = getattr(source.config, "model_type", type(source.config).__name__)
    quantised = getattr(source.config, "quantization_config", None)
    if quantised is not None:
        method = quantised.get("quant_method") if isinstance(quantised, dict) else getattr(quantised, "quant_method",
                                                                                             quantised)
        raise ValueError(f"{where}: {flag}: model {source.spec!r} is already quantised (quant_method {method}); "
                         "--qlora quantises a full-precision model: pass its unquantised weights")
    try:
        n = quantisable_linears(source.config)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not a causal LM transformers can build
        raise ValueError(f"{where}: {flag}: cannot build model family {family!r} to find its linears ({e})") from None
    if n == 0:
        raise ValueError(f"{where}: {flag}: model family {family!r} has no nn.Linear in its decoder layers for "
                         "bitsandbytes to quantise into NF4; train it without --qlora")


def import_bitsandbytes():
    """bitsandbytes, imported with the Hugging Face Hub offline: on CPUs with AVX512-BF16 its import looks up an
    optional kernel on the Hub (kernels-community), and fastrlhf contacts no server; its bundled kernels serve."""
    import huggingface_hub.constants as hub

    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    quiet = [logging.getLogger(name) for name in ("bitsandbytes", "kernels")]
    levels = [q.level for q in quiet]
    try:
        for q in quiet:
            q.setLevel(logging.ERROR)
        import bitsandbytes
    finally:
        hub.HF_HUB_OFFLINE = offline
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return bitsandbytes


def bnb_config(dtype: torch.dtype):
    """NF4 with double quantisation, computing in `dtype` (QLoRA's recipe)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def load_4bit(path, *, attn: str, device: torch.device, dtype: torch.dtype):
    """The model directory `path` with its decoder linears in NF4 and the rest in float32, every parameter
    frozen, ready for LoRA training."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    Linear4bit = import_bitsandbytes().nn.Linear4bit
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype,
                                                 quantization_config=bnb_config(dtype), device_map={"": str(device)})
    for m in model.modules():
        if isinstance(m, Linear4bit):
            # bitsandbytes repacks CPU weights for a faster no-grad kernel of other rounding: the rollout and the
            # scoring would then run another function than the one training runs
            m.support_avx512bf16_for_cpu = False
    # embeddings, norms and lm_head in float32 (fastrlhf enables checkpointing itself, without reentrancy)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _load_4bit(source: ModelSource, *, attn: str, device: torch.device, dtype: torch.dtype):
    """`load_4bit` of a model directory, or of a built-in config built as without --qlora (its random
    weights under the same seed) and saved to a temporary folder first."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="fastrlhf-qlora-") as tmp:
        path = source.spec
        if not Path(source.spec).is_dir():
            AutoModelForCausalLM.from_config(source.config).save_pretrained(tmp)
            path = tmp
        model = load_4bit(path, attn=attn, device=device, dtype=dtype)
    # what the adapters' config names as their base (peft's base_model_name_or_path): the user's directory, or
    # nothing for a built-in config (never the temporary folder)
    model.name_or_path = model.config._name_or_path = str(Path(path).resolve()) if path == source.spec else ""
    return model


def nf4_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 weights and their quantisation statistics."""
    return sum(p.numel() * p.element_size() + sum(t.numel() * t.element_size() for t in quant_stats(p))
               for p in model.parameters() if quant_stats(p))


def parameter_count(model: nn.Module) -> int:
    """Parameters of `model`, an NF4 weight counted as the matrix it holds (its storage packs two per byte)."""
    shape = lambda p: getattr(getattr(p, "quant_state", None), "shape", None)  # noqa: E731
    return sum(shape(p).numel() if shape(p) is not None else p.numel() for p in model.parameters())


def load_causal_lm(source, *, device: torch.device, dtype: torch.dtype = torch.float32,
                   gradient_checkpointing: bool = False, qlora: bool = False):
    """(model, tokenizer) of a `ModelSource`, a built-in config name (random weights, the char
    tokenizer) or a model directory; `qlora`: the decoder linears in NF4 (module docstring)."""
    from transformers import AutoModelForCausalLM

    if not isinstance(source, ModelSource):
        source = model_source(source)
    attn = attention_backend(device)
    if qlora:
        model = _load_4bit(source, attn=attn, device=device, dtype=dtype)
    elif Path(source.spec).is_dir():
        model = AutoModelForCausalLM.from_pretrained(source.spec, attn_implementation=attn, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(source.config, attn_implementation=attn)
    tokenizer = source.tokenizer
    model.config.pad_token_id = tokenizer.pad_token_id
    if not qlora:  # transformers refuses to cast a bitsandbytes model
        model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x on (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    n = parameter_count(model)
    cpu_threads_for(n, device)
    quant = f", NF4 block linears ({nf4_bytes(model) / 2**20:.2f} MiB)" if qlora else ""
    log.info("model %s: %.2fM parameters, attention=%s, dtype=%s, device=%s%s",
             source.spec, n / 1e6, attn, dtype, device, quant)
    return model, tokenizer


def merged_full_precision(lm, dtype: torch.dtype = torch.float32):
    """A plain causal LM (no peft, no bitsandbytes) of a LoRA-wrapped NF4 model: each quantised weight
    dequantised, plus its adapter's delta (`dtype`, the weights' full precision); the rest copied."""
    import copy

    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = unwrap(lm)
    config = copy.deepcopy(base.config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            layer = module.get_base_layer() if isinstance(module, LoraLayer) else module
            if isinstance(layer, Linear4bit):
                weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state).to(dtype)
                if isinstance(module, LoraLayer) and not module.merged:
                    for adapter in module.active_adapters:
                        weight += module.get_delta_weight(adapter).to(dtype)
                state[f"{name}.weight"] = weight
                if layer.bias is not None:
                    state[f"{name}.bias"] = layer.bias.detach().to(dtype)
            elif not isinstance(module, LoraLayer) and "lora_" not in name and ".base_layer" not in name:
                for key, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                    state[f"{name}.{key}" if name else key] = t.detach().to(dtype) if t.is_floating_point() else t
    plain.load_state_dict(state, strict=False, assign=True)
    for name, buffer in list(plain.named_buffers()):  # non-persistent buffers (rotary frequencies) from the source
        if buffer.is_meta and name in state:
            owner, _, key = name.rpartition(".")
            plain.get_submodule(owner)._buffers[key] = state[name].clone()
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    missing = [n for n, t in list(plain.named_parameters()) + list(plain.named_buffers()) if t.is_meta]
    if missing:
        raise RuntimeError(f"merged_full_precision: no weights for {missing[:5]}")
    return plain


def empty_copy(lm):
    """A causal LM of `lm`'s class and configuration whose weights are to be assigned (build
    it under `torch.device("meta")`): what a sharded run's final model is exported into."""
    import copy

    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(copy.deepcopy(unwrap(lm).config))


# ---------------------------------------------------------------- accessors


def unwrap(lm):
    """The plain HF causal LM under a peft wrapper (or `lm` itself)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def trunk(lm) -> nn.Module:
    """The decoder stack of a causal LM (e.g. LlamaModel): gives the final, normed hidden states."""
    base = unwrap(lm)
    return getattr(base, base.base_model_prefix)


def lm_head(lm) -> nn.Linear:
    return unwrap(lm).get_output_embeddings()


def hidden_states(lm, input_ids, attention_mask, position_ids, attention: dict | None = None) -> torch.Tensor:
    """[B, T, H] final hidden states; logits would be `hidden @ lm_head.weight.T`. `attention`: the
    forward's attention as the host planned it (fastrlhf.train.attention, on a model it was installed on;
    the 2-D mask is then not read); None: transformers builds the mask from the 2-D mask itself."""
    if attention is None:
        inputs = {"attention_mask": attention_mask}
    else:
        inputs = planned_inputs(unwrap(lm).config, input_ids, attention)
    return trunk(lm)(input_ids=input_ids, position_ids=position_ids, use_cache=False, **inputs).last_hidden_state


# ---------------------------------------------------------------- regional compilation

COMPILE_MODES = ("auto", "on", "off")
_COMPILED: dict = {}  # a decoder-layer class's forward -> its torch.compile (one per class, shared by every layer)


def compile_wanted(mode: str, device: torch.device) -> bool:
    """`--compile`: `auto` is on with CUDA, off on CPU (inductor's C++ compile of one layer costs
    ~15-120 s there and the tiny default gains nothing from it)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return device.type == "cuda" if mode == "auto" else mode == "on"


def _layer_forward(layer: nn.Module, *args, _backend: str = "inductor", **kwargs):
    """A decoder layer's forward: compiled for the full-sequence forwards (training and scoring),
    eager with a KV cache (generation's prefill and decode steps, whose lengths change every step)."""
    forward = type(layer).forward  # with transformers' gradient-checkpointing wrapper, so that is compiled too
    if kwargs.get("cache", kwargs.get("past_key_values")) is None:
        if (forward, _backend) not in _COMPILED:
            # dynamic shapes from the first call: the padded width changes with the prompts and responses,
            # and a static first graph would be compiled again (forward and backward) at the first new width
            _COMPILED[forward, _backend] = torch.compile(forward, backend=_backend, dynamic=True)
        # transformers >= 5.25 routes kernel-hub functions through a context variable that each attention
        # forward sets and resets (kernels' CompileableContextVar): a side effect that breaks the graph under
        # activation checkpointing unless dynamo may skip replaying it in the backward, where it is a no-op
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return _COMPILED[forward, _backend](layer, *args, **kwargs)
    return forward(layer, *args, **kwargs)


def compile_layers(module: nn.Module, enabled: bool = True, backend: str = "inductor") -> int:
    """Regional compilation: every decoder layer inside `module` (the policy and a frozen reference
    copy alike) runs one `torch.compile` of its class's forward: training forward and backward
    (AOTAutograd), LoRA adapters and gradient checkpointing inside it. Layers share the compiled
    code: one layer's compile serves the stack (a variant per grad mode, adapter state, first layer
    and shape class, never per step). FSDP's hooks stay outside (they are the module call's, not
    the forward's). `enabled` False: the layers run eagerly again. Returns the number of layers."""
    layers = decoder_layers(module)
    for layer in layers:
        if enabled:
            layer.forward = functools.partial(_layer_forward, layer, _backend=backend)
        else:
            layer.__dict__.pop("forward", None)
    return len(layers)


def compile_stats() -> dict[str, float]:
    """What torch.compile has done in this process: graphs compiled (each recompile is one more)
    and seconds spent compiling them, forward and backward (dynamo's own counters)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(compilation_time_metrics.get(k, ())) for k in ("_compile.compile_inner",
                                                                     "compile_fx.<locals>.bw_compiler"))
    return {"graphs": int(counters["stats"]["unique_graphs"]), "seconds": float(seconds)}
