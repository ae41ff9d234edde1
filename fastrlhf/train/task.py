"""The built-in task, "echo the key letter", and its character tokenizer (`--data builtin`).

A prompt is 3-6 letters from a..h followed by ":", e.g. "cafe:". Its key is the prompt's
first letter. A response is letters; its true score is the number of key letters among its
first 8 characters over max(8, its length):

    true_score("cafe:", "cccccccc") = 1.0,   true_score("cafe:", "cbcahdcc") = 0.5,
    true_score("cafe:", "cccc") = 0.5,       true_score("cafe:", "cccccccccc") = 0.8

The SFT data mixes good responses (8 x key) and poor ones (the prompt's second letter
repeated, or random letters that hit the key with probability 0.2), so the SFT policy
scores about 0.5-0.55 (measured): clearly imperfect.
Preference pairs are two responses drawn from that same mixture (a quarter of them cut
short), the higher-scoring one chosen: the reward model must learn "count the key letter"
from comparisons alone. `true_score` is also a rule reward: `--reward fastrlhf.train.task:true_score`.

The task's preset lengths (prompts 32 tokens, SFT/RM responses 16, PPO responses 12) are
used whenever a stage trains on it; user data gets lengths from the data (fastrlhf.train.data).
"""

from __future__ import annotations

import random

TASK_LETTERS = "abcdefgh"
TASK_RESPONSE_LEN = 8
GOOD_FRACTION = 0.5
POOR_KEY_PROB = 0.2
TRUNCATE_PROB = 0.2
EXTEND_PROB = 0.2
CHAR_VOCAB = " abcdefghijklmnopqrstuvwxyz0123456789:.,;!?-+=*/()'\"\n"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")

NUM_PPO_PROMPTS = 4096  # training prompts of the PPO stage
MAX_PROMPT_LEN = 32  # the task's preset lengths, in tokens (EOS included for responses)
MAX_RESPONSE_LEN = 16
MAX_NEW_TOKENS = 12


# ---------------------------------------------------------------- tokenizer


def build_char_tokenizer():
    """A character-level tokenizer (`tokenizers` WordLevel) with <pad>, <bos>, <eos>, <unk>;
    encoding a text with special tokens prepends <bos>. Saved and reloaded with AutoTokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHAR_VOCAB))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


# ---------------------------------------------------------------- data


def synthetic_prompts(n: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice(TASK_LETTERS) for _ in range(rng.randint(3, 6))) + ":" for _ in range(n)]


def _good_response(key: str) -> str:
    return key * TASK_RESPONSE_LEN


def _poor_response(prompt: str, rng: random.Random) -> str:
    """Half the time the prompt's second letter repeated (echoing the wrong letter), half the
    time random letters, each the key with probability POOR_KEY_PROB."""
    key = prompt[0]
    if rng.random() < 0.5:
        return prompt[1] * TASK_RESPONSE_LEN
    others = TASK_LETTERS.replace(key, "")
    return "".join(key if rng.random() < POOR_KEY_PROB else rng.choice(others) for _ in range(TASK_RESPONSE_LEN))


def _sample_response(prompt: str, rng: random.Random) -> str:
    return _good_response(prompt[0]) if rng.random() < GOOD_FRACTION else _poor_response(prompt, rng)


def synthetic_sft(n: int, seed: int) -> list[dict]:
    """(prompt, response) pairs from the good/poor mixture."""
    rng = random.Random(f"sft-{seed}")
    return [{"prompt": p, "response": _sample_response(p, rng)} for p in synthetic_prompts(n, rng)]


def _pair_response(prompt: str, rng: random.Random) -> str:
    """A response from the SFT mixture, cut short (0-7 letters) with probability TRUNCATE_PROB
    or run on (1-4 more letters) with probability EXTEND_PROB, so the reward model also learns
    that the length is part of the rule."""
    response = _sample_response(prompt, rng)
    u = rng.random()
    if u < TRUNCATE_PROB:
        return response[:rng.randint(0, TASK_RESPONSE_LEN - 1)]
    if u < TRUNCATE_PROB + EXTEND_PROB:
        return response + "".join(rng.choice(TASK_LETTERS) for _ in range(rng.randint(1, 4)))
    return response


def synthetic_pairs(n: int, seed: int) -> list[dict]:
    """(prompt, chosen, rejected): two responses from the SFT mixture (some cut short), ties redrawn."""
    rng = random.Random(f"rm-{seed}")
    rows = []
    while len(rows) < n:
        (prompt,) = synthetic_prompts(1, rng)
        a, b = _pair_response(prompt, rng), _pair_response(prompt, rng)
        sa, sb = true_score([prompt, prompt], [a, b])
        if sa != sb:
            chosen, rejected = (a, b) if sa > sb else (b, a)
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def synthetic_prompt_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    rng = random.Random(f"ppo-{split}-{seed}")
    return [{"prompt": p} for p in synthetic_prompts(n, rng)]


def true_score(prompts: list[str], responses: list[str]) -> list[float]:
    """The task's rule: (number of the first 8 response characters equal to the prompt's
    first letter) / max(8, response length), in [0, 1]: 1 only for exactly 8 key letters.
    Also usable as a rule-based reward: `--reward fastrlhf.train.task:true_score`."""
    scores = []
    for prompt, response in zip(prompts, responses):
        key = prompt[:1]
        hits = sum(ch == key for ch in response[:TASK_RESPONSE_LEN]) if key else 0
        scores.append(hits / max(TASK_RESPONSE_LEN, len(response)))
    return scores
