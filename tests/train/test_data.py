"""Data loading, tokenisation, collation, the synthetic task, and config parsing."""

import dataclasses
import json
import logging
import warnings

import pytest
import torch

from fastrlhf.train import data
from fastrlhf.train.checkpoint import RESUME_FREE_KEYS
from fastrlhf.train.config import (
    DPOConfig,
    PipelineConfig,
    PPOConfig,
    RMConfig,
    RunConfig,
    SFTConfig,
    field_docs,
    flat_fields,
    own_field_docs,
    parse_args,
)
from fastrlhf.train.data import Encoder, ensure_pad_token, load_table, pack, truncate_prompts, truncate_responses
from fastrlhf.train.task import build_char_tokenizer, synthetic_pairs, true_score


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
    enc = Encoder(tok)
    (ids,) = enc.responses(["x"], enc.prompts(["x"]), ["cab ba"])
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
    for cls in (SFTConfig, RMConfig, PPOConfig, DPOConfig, PipelineConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: no docstring for {missing}"


STAGE_CONFIGS = (SFTConfig, RMConfig, PPOConfig, DPOConfig)


def test_the_keys_every_stage_shares_are_declared_once_on_the_base():
    """Issue 29: each key every stage has is RunConfig's, with one docstring; a stage may redeclare
    one only for its own default (PPO logs every iteration), never restating its help."""
    base_docs = own_field_docs(RunConfig)
    base = {f.name for f in dataclasses.fields(RunConfig)}
    assert set(base_docs) == base
    own_defaults = {PPOConfig: {"log_every", "save_every"}}
    for cls in STAGE_CONFIGS:
        assert issubclass(cls, RunConfig)
        assert base & set(vars(cls)["__annotations__"]) == own_defaults.get(cls, set()), cls.__name__
        assert not base & set(own_field_docs(cls)), cls.__name__
        assert {k: field_docs(cls)[k] for k in base} == base_docs
        assert {k: flat_fields(cls)[k].type for k in base} == {k: flat_fields(RunConfig)[k].type for k in base}
    # nothing the stages declare themselves is the same key with the same help in all four
    assert not set.intersection(*(set(own_field_docs(cls).items()) for cls in STAGE_CONFIGS))
    assert "RESUME_FREE_KEYS" in base_docs["resume"]
    every_key = set().union(*(flat_fields(cls) for cls in STAGE_CONFIGS))
    assert set(RESUME_FREE_KEYS) <= every_key


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


# ---------------------------------------------------------------- a user's own tokenizers and data files


def _tokenizer(texts, *, prepend_space_marker: bool = False, vocab_size: int = 100):
    """A BPE tokenizer trained on `texts`. With `prepend_space_marker`, the legacy Llama-2
    `tokenizer.json` layout: a normalizer that prepends "▁" to every encoded text and turns spaces
    into "▁", split before each "▁"; else byte-level, as GPT-2 and Qwen. Neither adds BOS."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    if prepend_space_marker:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        alphabet = []
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                                           special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


WORD_TEXTS = ["sigma alpha -> alpha", "alpha omega -> omega", "omega sigma -> sigma", "alpha sigma -> sigma"] * 8


def test_a_tokenizer_that_prepends_a_space_marker_inserts_nothing_between_prompt_and_response():
    tok = _tokenizer(WORD_TEXTS, prepend_space_marker=True)
    assert tok.convert_ids_to_tokens(tok(" omega")["input_ids"]) == ["▁", "▁omega"]  # the marker, alone
    enc = Encoder(tok)
    prompts, responses = ["sigma alpha ->", "alpha sigma ->"], [" omega", " sigma"]
    prompt_ids = enc.prompts(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the prompts' tokens are a prefix of the joint tokens: no warning
        response_ids = enc.responses(prompts, prompt_ids, responses)
    for p, r, pi, ri in zip(prompts, responses, prompt_ids, response_ids):
        assert pi + ri == tok(p + r)["input_ids"] + [tok.eos_token_id]  # the text tokenized as one
        assert tok.convert_ids_to_tokens(ri)[0] == "▁" + r.strip()
        assert tok.decode(pi + ri, skip_special_tokens=True) == p + r


def test_tokens_merged_across_the_boundary_keep_the_prompts_own_tokens_with_a_warning():
    tok = _tokenizer(WORD_TEXTS, vocab_size=300)  # byte-level, " omega" is one token
    enc = Encoder(tok)
    prompts, responses = ["sigma alpha -> ", "alpha omega ->"], ["omega", " omega"]
    prompt_ids = enc.prompts(prompts)
    assert tok.convert_ids_to_tokens(prompt_ids[0])[-1] == "Ġ"  # the trailing space is a token of its own
    with pytest.warns(UserWarning, match=r"1 of 2 responses: tokenized after their prompt, the tokens merge across "
                                         r"the boundary \(first: prompt 'sigma alpha -> '"):
        response_ids = enc.responses(prompts, prompt_ids, responses)
    eos = tok.eos_token_id
    # row 0: the prompt stays the tokens generation conditions on; the response follows them
    assert response_ids[0] == tok("omega")["input_ids"] + [eos]
    assert tok.decode(prompt_ids[0] + response_ids[0], skip_special_tokens=True) == "sigma alpha -> omega"
    assert prompt_ids[1] + response_ids[1] == tok("alpha omega -> omega")["input_ids"] + [eos]


def test_prompts_that_encode_to_no_tokens_are_refused_with_their_row():
    tok = _tokenizer(WORD_TEXTS)
    assert tok("")["input_ids"] == []  # no BOS
    enc = Encoder(tok)
    with pytest.raises(ValueError, match=r"sft data: q\.jsonl: 1 of 3 prompts encode to no tokens \(first: row 1, "
                                         r"prompt ''\) and the tokenizer adds no BOS token"):
        enc.prompts(["sigma ->", "", "alpha ->"], where="sft data: q.jsonl")
    assert enc.prompts(["sigma ->", ""])[1] == []  # without `where` (re-tokenizing for a reward model): allowed


def _empty_data_files(folder):
    import datasets

    empty = datasets.Dataset.from_dict({"prompt": [], "response": []})
    empty.save_to_disk(str(folder / "saved"))
    datasets.DatasetDict({"train": empty}).save_to_disk(str(folder / "saved_dict"))
    (folder / "empty.jsonl").write_text("")
    (folder / "blank.jsonl").write_text("\n  \n")
    (folder / "empty.json").write_text("[]")
    datasets.Dataset.from_dict({"prompt": ["a"], "response": ["b"]}).select([]).to_parquet(str(folder / "e.parquet"))
    (folder / "empty.parquet").write_bytes(b"")
    (folder / "header.csv").write_text("prompt,response\n")
    (folder / "empty.csv").write_text("")
    return ["saved", "saved_dict", "empty.jsonl", "blank.jsonl", "empty.json", "e.parquet", "empty.parquet",
            "header.csv", "empty.csv"]


def test_empty_data_of_every_format_says_it_has_no_rows(tmp_path):
    for name in _empty_data_files(tmp_path):
        with pytest.raises(ValueError, match=rf"^sft data: {tmp_path / name} has no rows"):
            load_table(str(tmp_path / name), {"prompt": "prompt", "response": "response"}, where="sft data")


def test_a_missing_column_names_the_flag_with_its_prefix(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": "a", "good": "b", "bad": "c"}\n')
    with pytest.raises(ValueError, match=r"has no column 'prompt' \(for the prompt\), 'chosen' \(for the chosen\); "
                                         r"its columns are \['q', 'good', 'bad'\] \(map yours with --rm\.prompt_key, "
                                         r"--rm\.chosen_key\)"):
        load_table(str(path), {"prompt": "prompt", "chosen": "chosen", "rejected": "bad"}, where="rm data",
                   key_prefix="rm.")


@pytest.mark.parametrize("template", [False, True])
def test_encoding_many_texts_shows_progress_and_gives_the_same_ids(template, monkeypatch, caplog):
    """From PROGRESS_TEXTS texts on, encoding logs its progress (log lines: no terminal here) and
    the plain rule tokenizes in blocks of ENCODE_BLOCK; the ids are those of one call."""
    tok = build_char_tokenizer()
    if template:
        tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
                             "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                             "{% if add_generation_prompt %}a:{% endif %}")
    prompts, responses = [f"ab{'c' * i}:" for i in range(10)], [f"{'d' * i}ba" for i in range(10)]
    want_p = Encoder(tok).prompts(prompts)
    want_r = Encoder(tok).responses(prompts, want_p, responses)
    assert not caplog.records  # below the threshold: no progress
    monkeypatch.setattr(data, "PROGRESS_TEXTS", 4)
    monkeypatch.setattr(data, "ENCODE_BLOCK", 3)
    with caplog.at_level(logging.INFO, logger="fastrlhf"):
        got_p = Encoder(tok).prompts(prompts)
        got_r = Encoder(tok).responses(prompts, got_p, responses)
    assert (got_p, got_r) == (want_p, want_r)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("encoding prompts: 10/10 (100%)") for line in lines), lines
    assert any(line.startswith("encoding responses: 10/10 (100%)") for line in lines), lines


# ---------------------------------------------------------------- issue 22: input that was silently accepted


def test_text_that_is_not_utf8_names_the_file_and_the_line(tmp_path):
    jsonl, csv = tmp_path / "q.jsonl", tmp_path / "q.csv"
    jsonl.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    csv.write_bytes(b"prompt,response\na,b\ncaf\xe9,b\n")
    columns = {"prompt": "prompt", "response": "response"}
    with pytest.raises(ValueError, match=rf"^sft data: {jsonl}:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_table(str(jsonl), columns, where="sft data")
    with pytest.raises(ValueError, match=rf"^sft data: {csv}:3: not UTF-8 text \(byte 0xe9 at column 4\); save the "
                                         "file as UTF-8"):
        load_table(str(csv), columns, where="sft data")


def test_a_column_named_twice_is_an_error(tmp_path):
    csv, jsonl = tmp_path / "q.csv", tmp_path / "q.jsonl"
    csv.write_text("prompt,response,prompt\na,b,c\n")  # the reader would rename the second one prompt.1
    jsonl.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "prompt": "b", "response": "c"}\n')
    columns = {"prompt": "prompt", "response": "response"}
    with pytest.raises(ValueError, match=rf"{csv}:1: the header names column\(s\) 'prompt' more than once"):
        load_table(str(csv), columns, where="sft data")
    with pytest.raises(ValueError, match=rf"{jsonl}:2: key 'prompt' appears twice in one object"):
        load_table(str(jsonl), columns, where="sft data")


def test_empty_prompts_are_counted_in_a_warning():
    enc = Encoder(build_char_tokenizer())  # adds BOS: an empty prompt still has a token
    with pytest.warns(UserWarning, match=r"sft data: q\.jsonl: 2 of 4 prompts are empty or blank \(first: row 1\); "
                                         r"the model sees the tokenizer's special tokens alone there"):
        enc.prompts(["abc:", "", "de:", "  "], where="sft data: q.jsonl")


def test_a_non_integer_for_an_integer_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    for value, shown in (("3.7", "3.7"), ("true", "True")):
        path.write_text(f"steps: {value}\n")
        with pytest.raises(ValueError, match=rf"config key 'steps' expects an integer, got {shown}"):
            parse_args(SFTConfig, ["--config", str(path)])
    path.write_text("steps: 3.0\nlr: 1\n")  # an integral float is an integer; an int is a float
    cfg = parse_args(SFTConfig, ["--config", str(path)])
    assert (cfg.steps, cfg.lr) == (3, 1.0) and isinstance(cfg.steps, int)
    with pytest.raises(ValueError, match="'steps' expects int, got '3.7'"):
        parse_args(SFTConfig, ["--steps", "3.7"])


def test_a_yaml_error_gives_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\nlr: [0.1\nseed: 1\n")
    with pytest.raises(ValueError, match=rf"config file '{path}', line 3, column 5: not valid YAML"):
        parse_args(SFTConfig, ["--config", str(path)])
    path.write_bytes(b"steps: 3\ndata: caf\xe9.jsonl\n")
    with pytest.raises(ValueError, match=rf"config file '{path}', line 2: not UTF-8 text"):
        parse_args(SFTConfig, ["--config", str(path)])
