"""ExactAnswerAccuracy's arguments (its scores are tested through ``lit-memtrain fit`` in tests/cli)."""

import pytest

from lit_memtrain.callbacks import ExactAnswerAccuracy


def test_the_callback_refuses_an_empty_measure():
    with pytest.raises(ValueError, match="must be at least 1; got 0, 8 and 50"):
        ExactAnswerAccuracy(num_prompts=0)
