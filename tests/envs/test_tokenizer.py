"""Word-level tokenizer of the code-repair environment."""

import numpy as np

from agentrl_jax.envs.base import Tokenizer
from agentrl_jax.envs.coderepair.task import make_task
from agentrl_jax.envs.coderepair.tokenizer import SPECIALS, CodeTokenizer


def test_vocab_is_small_unique_and_has_distinct_specials():
    tok = CodeTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size <= 512
    assert len(set(tok.words)) == tok.vocab_size
    ids = [tok.pad_id, tok.bos_id, tok.eos_id, tok.call_start_id, tok.call_end_id]
    ids += [tok.obs_start_id, tok.obs_end_id, tok.eot_id, tok.nl_id, tok.unk_id]
    assert ids == list(range(len(SPECIALS)))


def test_numbers_are_spelled_by_digit_and_lines_are_single_tokens():
    tok = CodeTokenizer()
    ids = tok.encode("L17 x = 123 - -5\ny")
    assert tok.to_words(ids) == ["L17", "x", "=", "1", "2", "3", "-", "-", "5", "<nl>", "y"]
    assert tok.to_words(ids, glue_digits=True)[2:4] == ["=", "123"]
    assert tok.decode(ids) == "L17 x = 1 2 3 - - 5\ny"
    assert tok.encode("frobnicate") == [tok.unk_id]


def test_encode_decode_round_trip_on_random_ids():
    tok = CodeTokenizer()
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, tok.vocab_size, size=50).tolist()
        ids = [i for i in ids if i != tok.unk_id]
        assert tok.encode(tok.decode(ids)) == ids


def test_every_word_of_generated_programs_is_one_token():
    tok = CodeTokenizer()
    for d in range(5):
        for seed in range(3):
            task = make_task(seed, d)
            for words in task.lines + task.original:
                assert tok.to_words(tok.encode_words(words)) == list(words)
