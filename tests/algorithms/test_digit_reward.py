"""The digit reward, and its two adapters (the demo's ``digits`` task on tokens, the CPU smoke run's
verl reward on text) scoring one response alike."""

from __future__ import annotations

import pytest

from zero_mismatch_plugin.algorithms.digit_reward import digit_share, is_digit_piece
from zero_mismatch_plugin.integrations.verl.cpu.digit_reward import compute_score
from zero_mismatch_plugin.tools.demo.task import DigitTask


@pytest.mark.parametrize("piece, expected", [("7", True), (" 42", True), ("  0", True), ("4 ", False),
                                             ("\t4", False), ("²", False), ("a1", False), ("", False),
                                             (" ", False)])
def test_a_digit_piece_is_ascii_digits_after_leading_spaces(piece, expected):
    assert is_digit_piece(piece) is expected


def test_digit_share_is_the_share_of_digit_pieces():
    assert digit_share([]) == 0.0
    assert digit_share(["1", "a", " 2", "b"]) == 0.5


# One visible character per token, spaces only leading a token: the token and character counts agree.
TOKEN_TEXTS = {0: "a", 1: "1", 2: " 2", 3: "b", 4: " c", 5: "9", 6: "?"}


@pytest.mark.parametrize("response", [[], [1], [0], [1, 2, 5], [0, 1, 3, 4], [6, 2, 2, 4, 5, 0], [4, 4]])
def test_demo_task_and_verl_reward_give_the_same_values(response):
    task = DigitTask(prompts=[[0]], vocab_size=len(TOKEN_TEXTS), token_texts=TOKEN_TEXTS)
    text = "".join(TOKEN_TEXTS[t] for t in response)
    assert task.reward([0], response) == compute_score("zmrl_digits", text) == digit_share(
        [c for c in text if not c.isspace()])
