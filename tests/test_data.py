"""Data loading, tokenisation, collation, the synthetic task, and config parsing."""

import dataclasses
import json
import warnings

import pytest
import torch

from fastrlhf.config import PipelineConfig, PPOConfig, RMConfig, SFTConfig, field_docs, parse_args
from fastrlhf.data import Encoder, ensure_pad_token, load_table, pack, truncate_prompts, truncate_responses
from fastrlhf.task import build_char_tokenizer, synthetic_pairs, true_score


def test_load_table_reports_malformed_line_number(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c", "response": \n')
    with pytest.raises(ValueError, match=r"sft data: .*d\.jsonl:3: malformed JSON line"):
        load_table(str(path), {"prompt": "prompt", "response": "response"}, where="sft data")


def test_load_table_reports_missing_column_null_value_and_missing_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n')
    with pytest.raises(ValueError, match=r"no column 'response' \(for the response\); its columns are "
                                         r"\['prompt', 'answer'\] \(map yours with --response_key\)"):
        load_table(str(path), {"prompt": "prompt", "response": "response"}, where="sft data")
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": null}\n')
    with pytest.raises(ValueError, match=r"row 1: column 'response' is null; expected text"):
        load_table(str(path), {"prompt": "prompt", "response": "response"}, where="sft data")
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 3, "response": "c"}\n')
    with pytest.raises(ValueError, match=r"row 1: column 'prompt' is a int \(3\); expected text"):
        load_table(str(path), {"prompt": "prompt", "response": "response"}, where="sft data")
    with pytest.raises(ValueError, match="does not exist"):
        load_table(str(tmp_path / "nope.jsonl"), {"prompt": "prompt"}, where="ppo data")
    with pytest.raises(ValueError, match=r"expected a file ending in \.jsonl, \.json, \.parquet, \.csv"):
        (tmp_path / "d.txt").write_text("x")
        load_table(str(tmp_path / "d.txt"), {"prompt": "prompt"}, where="ppo data")


def test_load_table_maps_columns_from_jsonl_parquet_and_a_saved_dataset(tmp_path):
    import datasets

    rows = [{"question": "ab:", "good": "aa", "bad": "bb", "extra": 1}, {"question": "c:", "good": "c", "bad": "d",
                                                                          "extra": 2}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    for path in ("d.jsonl", "d.parquet", "saved"):
        table = load_table(str(tmp_path / path), columns, where="rm data")
        assert table.column_names == ["prompt", "chosen", "rejected"], path
        assert table.to_list() == [{"prompt": "ab:", "chosen": "aa", "rejected": "bb"},
                                   {"prompt": "c:", "chosen": "c", "rejected": "d"}], path


def test_tokenizer_without_pad_uses_eos_and_warns():
    tok = build_char_tokenizer()
    tok.pad_token = None
    with pytest.warns(UserWarning, match="no pad token"):
        ensure_pad_token(tok)
    assert tok.pad_token_id == tok.eos_token_id


def test_long_prompts_are_truncated_from_the_left_with_a_warning():
    tok = build_char_tokenizer()
    with pytest.warns(UserWarning, match="1 of 2 prompts are longer than max_prompt_len=4"):
        ids = truncate_prompts(Encoder(tok).prompts(["abcdefg", "ab"]), 4)
    assert ids[0] == tok("defg", add_special_tokens=False)["input_ids"]  # the end of the prompt is kept
    assert ids[1] == [tok.bos_token_id] + tok("ab", add_special_tokens=False)["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        truncate_prompts(Encoder(tok).prompts(["ab"]), 4)  # no warning when nothing is cut


def test_long_responses_are_truncated_with_a_warning_and_a_count():
    tok = build_char_tokenizer()
    enc = Encoder(tok)
    ids = enc.responses(["a", "b", "c"], enc.prompts(["a", "b", "c"]), ["abcdef", "ab", "abcdefgh"])
    with pytest.warns(UserWarning, match=r"2 of 3 responses are longer than max_response_len=4 tokens "
                                         r"\(EOS included\); keeping their first tokens, without EOS"):
        cut = truncate_responses(ids, 4)
    assert cut[0] == tok("abcd", add_special_tokens=False)["input_ids"]
    assert cut[1] == tok("ab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_plain_rule_joins_prompt_tokens_then_response_tokens_and_eos():
    tok = build_char_tokenizer()
    enc = Encoder(tok, chat_template=True)  # the char tokenizer has no template: the plain rule
    assert not enc.uses_template
    (p,) = enc.prompts(["ab:"])
    (r,) = enc.responses(["ab:"], [p], ["cab ba"])
    assert p == [tok.bos_token_id] + tok("ab:", add_special_tokens=False)["input_ids"]
    assert r == tok("cab ba", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # nothing in between
    assert tok.decode(p + r, skip_special_tokens=True) == "ab:cab ba"


def test_chat_template_rule_takes_the_assistant_turn_up_to_eos():
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                         "{{ eos_token }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    enc = Encoder(tok)
    assert enc.uses_template
    (p,) = enc.prompts(["ab"])
    (r,) = enc.responses(["ab"], [p], ["cd"])
    assert tok.decode(p) == "u:aba:"  # the user turn, then the assistant's turn opened
    assert r == tok("cd", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # the "\n" after EOS is cut
    assert not Encoder(tok, chat_template=False).uses_template  # the opt-out


def test_empty_responses_are_counted_in_a_warning():
    tok = build_char_tokenizer()
    enc = Encoder(tok)
    with pytest.warns(UserWarning, match="1 of 2 responses are empty"):
        ids = enc.responses(["a", "b"], enc.prompts(["a", "b"]), ["", "x"])
    assert ids[0] == [tok.eos_token_id]


def test_char_tokenizer_roundtrip_and_eos():
    tok = build_char_tokenizer()
    (ids,) = Encoder(tok).responses(["x"], [[1]], ["cab ba"])
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


def test_unknown_key_suggests_the_closest_valid_keys(tmp_path):
    """Issue 14 finding 8: the unknown-key error named ~90 keys instead of the closest one."""
    with pytest.raises(ValueError, match=r"unknown config key\(s\): 'stepz' \(did you mean 'steps'\?\)") as e:
        parse_args(SFTConfig, ["--stepz", "3"])
    assert "batch_size" not in str(e.value)  # no dump of every key
    with pytest.raises(ValueError, match=r"'kl_coef' \(did you mean 'ppo.kl_coef'\?\)"):
        parse_args(PipelineConfig, ["--kl_coef", "0.1"])  # the key without its stage prefix
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  kl_coeff: 1\n")
    with pytest.raises(ValueError, match=r"'ppo.kl_coeff' \(did you mean 'ppo.kl_coef'"):
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
