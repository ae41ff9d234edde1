"""--qlora: the refusals before a model loads, and sft / ppo / dpo on a 4-bit base of a tiny Llama and a
tiny Qwen2 folder: each resumes exactly, and its final model (merged weights, and the adapters on the
4-bit base) gives the log-probs the trained model gave at the end of training."""

import json
from pathlib import Path

import helpers
import pytest
import torch
from helpers import main_in_process, metric_rows
from local_model import REWARD_FILE, bpe_tokenizer, make_local_model, task_rows, write_task_data

from fastrlhf.train import heads, models
from fastrlhf.train.checkpoint import ADAPTER_DIR
from fastrlhf.train.config import DPOConfig, PipelineConfig, PPOConfig, SFTConfig
from fastrlhf.train.recipes import dpo, pipeline, ppo, sft

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("keep_threads_and_warnings")

PROBE = torch.tensor([[5, 9, 17, 30, 11, 7, 21, 3], [40, 2, 8, 8, 19, 33, 6, 12]])


def _llama_folder(path: Path, tokenizer) -> Path:
    """A 2-layer Llama with random weights and the BPE tokenizer, saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"llama": DIR, "qwen2": DIR}, their JSONL data and a reward rule file."""
    root = tmp_path_factory.mktemp("qlora")
    rows = task_rows(200)
    tokenizer = bpe_tokenizer([r["prompt"] + r["response"] for r in rows])
    (root / "qlora_reward.py").write_text(REWARD_FILE)
    return ({"llama": _llama_folder(root / "llama", tokenizer), "qwen2": make_local_model(root / "qwen2")},
            write_task_data(root), root)


# ---------------------------------------------------------------- refusals, before any model loads


def test_qlora_without_bitsandbytes_is_refused_with_the_install_line(monkeypatch, tmp_path, capsys, caplog):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else real(name, *a))
    loaded = []
    monkeypatch.setattr(sft, "load_causal_lm", lambda *a, **k: loaded.append(a))
    r = main_in_process("sft", "--qlora", "--lora_rank", "8", "--out", str(tmp_path / "run"), capsys=capsys,
                        caplog=caplog)
    assert r.returncode == 2
    assert 'sft: --qlora needs bitsandbytes, which is not installed: pip install "fastrlhf[qlora]"' in r.stderr
    assert loaded == [] and not (tmp_path / "run").exists()
    cfg = PipelineConfig(out=str(tmp_path / "p"), qlora=True)
    with pytest.raises(ValueError, match=r"rm: --rm\.qlora needs bitsandbytes"):  # sft: the built-in trains whole
        pipeline.prepare(cfg)


def test_pipeline_qlora_trains_a_random_built_in_whole_in_sft_and_the_rest_on_4_bits(tmp_path):
    """`pipeline --qlora` on the embedded default: its SFT starts from random weights (nothing pretrained to
    keep in 4 bits; rank-16 adapters on a random base and lm_head reach SFT loss 2.09 against 0.60 trained
    whole), so it trains whole, and rm and ppo train adapters on the 4-bit copy of what SFT made (measured:
    RM accuracy 0.93, true score 0.545 -> 0.979). From a model directory SFT is QLoRA too."""
    resolved, _ = pipeline.prepare(PipelineConfig(out=str(tmp_path / "p"), qlora=True))
    assert (resolved["sft"]["qlora"], resolved["sft"]["lora_rank"]) == (False, 0)
    assert resolved["rm"]["qlora"] and resolved["ppo"]["qlora"] and resolved["ppo"]["lora_rank"] == 16
    folder = tmp_path / "base"
    sft.train(SFTConfig(out=str(folder), steps=1, save_every=1))
    resolved, _ = pipeline.prepare(PipelineConfig(out=str(tmp_path / "q"), qlora=True,
                                                  sft=SFTConfig(model=str(folder / "sft" / "final"))))
    assert resolved["sft"]["qlora"] and resolved["sft"]["lora_rank"] == 16


def test_qlora_needs_lora_adapters(tmp_path):
    with pytest.raises(ValueError, match=r"ppo: --qlora trains LoRA adapters on a frozen 4-bit base: --lora_rank "
                                         r"must be > 0 \(e\.g\. 16\), got 0"):
        ppo.prepare(PPOConfig(**dict(helpers.TINY_PPO, out=str(tmp_path), qlora=True, lora_rank=0)))
    with pytest.raises(ValueError, match=r"dpo: --qlora .* --lora_rank must be > 0"):
        dpo.prepare(DPOConfig(model="tiny", out=str(tmp_path), qlora=True))  # DPO's default: full fine-tuning
    with pytest.raises(ValueError, match=r"sft: --qlora .* --lora_rank must be > 0"):
        sft.prepare(SFTConfig(out=str(tmp_path), qlora=True))


def test_qlora_refuses_a_family_bitsandbytes_cannot_quantise(tmp_path):
    """Falcon's decoder layers hold FalconLinear, a subclass of nn.Linear that transformers' bitsandbytes
    path leaves unquantised; a model saved quantised already is refused too."""
    from transformers import FalconConfig, LlamaConfig

    tokenizer = bpe_tokenizer([r["prompt"] + r["response"] for r in task_rows(50)])
    falcon = tmp_path / "falcon"
    FalconConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 eos_token_id=tokenizer.eos_token_id).save_pretrained(falcon)
    tokenizer.save_pretrained(falcon)
    data = write_task_data(tmp_path)
    with pytest.raises(ValueError, match=r"sft: --qlora: model family 'falcon' has no nn\.Linear in its decoder "
                                         r"layers for bitsandbytes to quantise into NF4"):
        sft.prepare(SFTConfig(model=str(falcon), data=str(data["sft"]), out=str(tmp_path / "r"), qlora=True,
                              lora_rank=4))
    quantised = tmp_path / "gptq"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, eos_token_id=tokenizer.eos_token_id)
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    config.save_pretrained(quantised)
    tokenizer.save_pretrained(quantised)
    with pytest.raises(ValueError, match=r"is already quantised \(quant_method gptq\)"):
        sft.prepare(SFTConfig(model=str(quantised), data=str(data["sft"]), out=str(tmp_path / "r"), qlora=True,
                              lora_rank=4))


# ---------------------------------------------------------------- training on a 4-bit base


def _probe_logprobs(lm) -> torch.Tensor:
    """[2, 7] log-probs of PROBE's next tokens."""
    with torch.no_grad():
        logits = lm(input_ids=PROBE, attention_mask=torch.ones_like(PROBE)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, PROBE[:, 1:, None]).squeeze(-1)


STAGES = {
    "sft": lambda d: ["--data", str(d["sft"]), "--batch_size", "4", "--lora_rank", "4", "--lr", "1e-2"],
    "dpo": lambda d: ["--data", str(d["rm"]), "--batch_size", "4", "--lora_rank", "4", "--lr", "1e-2",
                      "--eval_fraction", "0.25", "--eval_every", "2"],
    "ppo": lambda d: ["--data", str(d["ppo"]), "--reward", "qlora_reward:score", "--rollout_batch_size", "4",
                      "--mini_batch_size", "2", "--micro_batch_size", "2", "--max_new_tokens", "3", "--lora_rank",
                      "4", "--lr", "1e-2"],
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("stage", ["sft", "dpo", "ppo"])
def test_qlora_stage_resumes_exactly_and_its_final_model_reloads(stage, family, folders, tmp_path, monkeypatch,
                                                                 capsys, caplog):
    model_dirs, data, root = folders
    monkeypatch.chdir(root)  # the rule reward's module
    monkeypatch.syspath_prepend(str(root))
    ended = []
    real_plain = heads.plain_model

    def plain_model(lm):  # what the stage saves: the trained model at the end of training
        ended.append((heads.is_4bit(lm), _probe_logprobs(lm)))
        return real_plain(lm)

    monkeypatch.setattr(heads, "plain_model", plain_model)
    args = ["--model", str(model_dirs[family]), "--qlora", "--steps", "4", "--save_every", "2", *STAGES[stage](data)]

    def cli(out, *more):
        r = main_in_process(stage, "--out", str(out), *args, *more, capsys=capsys, caplog=caplog)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    full, split = tmp_path / "full", tmp_path / "split"
    assert "NF4 block linears" in cli(full).stderr
    cli(split, "--stop_after", "2")
    assert "resumed from" in cli(split, "--resume").stderr
    assert metric_rows(split, stage, timing=False) == metric_rows(full, stage, timing=False)
    # the checkpoint holds the adapters (and a value head), never the base
    names = json.loads((split / stage / "checkpoints" / "step_000004" / "manifest.json").read_text())["files"]
    from safetensors.torch import load_file

    saved = load_file(split / stage / "checkpoints" / "step_000004" / "model.safetensors")
    assert "model.safetensors" in names and saved and all("lora_" in k or "value_head" in k for k in saved)
    # both runs ended with the same model; the saved one gives its log-probs
    assert len(ended) == 2 and ended[0][0] and torch.equal(ended[0][1], ended[1][1])
    trained = ended[0][1]
    final = full / stage / "final"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(final)
    assert not getattr(merged, "is_loaded_in_4bit", False)
    assert (_probe_logprobs(merged) - trained).abs().max().item() < 1e-4
    base, _ = models.load_causal_lm(model_dirs[family], device=torch.device("cpu"), qlora=True)
    adapted = PeftModel.from_pretrained(base, final / ADAPTER_DIR)
    assert (_probe_logprobs(adapted) - trained).abs().max().item() < 1e-4


def test_qlora_rm_critic_free_ppo_and_distill_student(tmp_path, capsys, caplog):
    """The other stages on a 4-bit base of the built-in `tiny`: the reward model (LoRA trunk, float32 score
    head), critic-free PPO (GRPO), and on-policy distillation into a 4-bit student, whose --rollout_engine
    graph declines the 4-bit base (the hf path samples from it) and whose teacher stays unquantised."""
    from safetensors.torch import load_file

    def cli(*args):
        r = main_in_process(*args, capsys=capsys, caplog=caplog)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    rm_out = tmp_path / "rm"
    cli("rm", "--model", "tiny", "--data", "builtin", "--out", str(rm_out), "--qlora", "--lora_rank", "4", "--steps",
        "3", "--batch_size", "4", "--num_pairs", "40", "--eval_every", "3")
    saved = load_file(rm_out / "rm" / "checkpoints" / "step_000003" / "model.safetensors")
    assert any(k.startswith("head.") for k in saved) and all("lora_" in k or k.startswith("head.") for k in saved)
    assert (rm_out / "rm" / "final" / "score_head.safetensors").is_file()
    assert (rm_out / "rm" / "final" / ADAPTER_DIR / "adapter_config.json").is_file()
    r = cli("ppo", *[f"--{k}={v}" for k, v in helpers.TINY_PPO.items()], "--out", str(tmp_path / "grpo"), "--qlora",
            "--advantage", "grpo", "--num_generations", "2", "--steps", "2", "--reward", str(rm_out / "rm" / "final"))
    assert "NF4 block linears" in r.stderr
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())["ppo"]
    assert summary["steps"] == 2
    r = cli("distill", "--teacher", "tiny", "--model", "tiny-student", "--out", str(tmp_path / "d"), "--qlora",
            "--lora_rank", "4", "--steps", "2", "--batch_size", "4", "--eval_prompts", "4", "--mode", "on_policy",
            "--rollout_engine", "graph")
    assert "rollout: engine hf (--rollout_engine graph, but the base is 4-bit (--qlora)" in r.stderr
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["distill"]["steps"] == 2
