"""Data loading, tokenisation, collation, the synthetic task, and config parsing."""

import dataclasses
import warnings

import pytest
import torch

from fastrlhf.config import PipelineConfig, PPOConfig, RMConfig, SFTConfig, field_docs, parse_args
from fastrlhf.data import encode_prompts, encode_responses, ensure_pad_token, pack, read_jsonl
from fastrlhf.task import build_char_tokenizer, synthetic_pairs, true_score


def test_read_jsonl_reports_malformed_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c", "response": \n')
    with pytest.raises(ValueError, match=r"d\.jsonl:3: malformed JSON"):
        read_jsonl(str(path), ("prompt", "response"))


def test_read_jsonl_reports_missing_key_and_missing_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: missing string field\(s\) \['response'\]"):
        read_jsonl(str(path), ("prompt", "response"))
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(str(tmp_path / "nope.jsonl"), ("prompt",))


def test_read_jsonl_reads_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ab:", "chosen": "aa", "rejected": "bb", "extra": 1}\n')
    assert read_jsonl(str(path), ("prompt", "chosen", "rejected")) == [
        {"prompt": "ab:", "chosen": "aa", "rejected": "bb"}]


def test_tokenizer_without_pad_uses_eos_and_warns():
    tok = build_char_tokenizer()
    tok.pad_token = None
    with pytest.warns(UserWarning, match="no pad token"):
        ensure_pad_token(tok)
    assert tok.pad_token_id == tok.eos_token_id


def test_long_prompts_are_truncated_from_the_left_with_a_warning():
    tok = build_char_tokenizer()
    with pytest.warns(UserWarning, match="1 of 2 prompts are longer than max_prompt_len=4"):
        ids = encode_prompts(tok, ["abcdefg", "ab"], max_len=4)
    assert ids[0] == tok("defg", add_special_tokens=False)["input_ids"]  # the end of the prompt is kept
    assert ids[1] == [tok.bos_token_id] + tok("ab", add_special_tokens=False)["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode_prompts(tok, ["ab"], max_len=4)  # no warning when nothing is cut


def test_char_tokenizer_roundtrip_and_eos():
    tok = build_char_tokenizer()
    (ids,) = encode_responses(tok, ["cab ba"], max_len=16)
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "cab ba"


def test_pack_layout():
    batch = pack([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], pad_id=0)
    assert batch.prompt_len == 3
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 2, 0], [0, 1, 7, 9, 9, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 1, 2, 3, 4]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.responses.tolist() == [[8, 2, 0], [9, 9, 2]]


def test_true_score_hand_worked():
    prompts = ["cafe:"] * 5
    responses = ["cccccccc", "cbcahdcc", "cccc", "cccccccccc", "aaaaaaaa"]
    assert true_score(prompts, responses) == [1.0, 0.5, 0.5, 0.8, 0.0]


def test_synthetic_pairs_prefer_the_higher_true_score():
    rows = synthetic_pairs(200, seed=3)
    chosen = true_score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = true_score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert all(c > r for c, r in zip(chosen, rejected))
    assert synthetic_pairs(5, seed=3) == rows[:5]  # deterministic in the seed


# ---------------------------------------------------------------- config


def test_every_config_field_has_a_docstring():
    for cls in (SFTConfig, RMConfig, PPOConfig, PipelineConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: no docstring for {missing}"


def test_yaml_then_cli_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.5\nsteps: 7\nresume: true\n")
    cfg = parse_args(PPOConfig, ["--config", str(path), "--steps", "9", "--kl-coef=0.3", "--tensorboard"])
    assert (cfg.lr, cfg.steps, cfg.kl_coef, cfg.resume, cfg.tensorboard) == (0.5, 9, 0.3, True, True)


def test_pipeline_dotted_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("out: x\nppo:\n  steps: 3\n")
    cfg = parse_args(PipelineConfig, ["--config", str(path), "--rm.steps", "4"])
    assert (cfg.out, cfg.ppo.steps, cfg.rm.steps, cfg.sft.steps) == ("x", 3, 4, SFTConfig().steps)


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['stepz'\]; valid keys: .*steps"):
        parse_args(SFTConfig, ["--stepz", "3"])
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  nope: 1\n")
    with pytest.raises(ValueError, match=r"\['ppo.nope'\].*ppo\.kl_coef"):
        parse_args(PipelineConfig, ["--config", str(path)])


def test_bad_value_names_the_key():
    with pytest.raises(ValueError, match="'steps' expects int"):
        parse_args(SFTConfig, ["--steps", "many"])
    with pytest.raises(ValueError, match="'resume' expects a boolean"):
        parse_args(SFTConfig, ["--resume", "maybe"])


def test_pack_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pack([[1], [2]], [[3]], pad_id=0)
    assert torch.is_tensor(pack([[1]], [[3]], pad_id=0).input_ids)
