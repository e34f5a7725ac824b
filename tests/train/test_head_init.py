"""train/head_init.py: the draft vocabulary a new head is trained over."""
from __future__ import annotations

import numpy as np
import pytest

from eagle_deploy.train.head_init import draft_ids


def test_draft_ids_keep_every_eos_id_of_the_session_even_unseen_ones():
    """Qwen2.5 stops on two ids (<|im_end|> and <|endoftext|>); both enter the draft vocabulary
    even when no answer ended on one of them, and the rest are the most frequent tokens."""
    counts = np.zeros(50, np.int64)
    counts[[3, 7, 11, 20, 40]] = [50, 40, 30, 20, 10]
    counts[45] = 5  # one EOS id seen, the other (46) never
    ids = draft_ids(counts, 4, eos_ids=[45, 46])
    assert ids.tolist() == [3, 7, 45, 46]
    assert draft_ids(counts, 4, eos_ids=[]).tolist() == [3, 7, 11, 20]


@pytest.mark.parametrize("size", [0, 51])
def test_draft_ids_refuse_a_size_outside_the_vocabulary(size):
    with pytest.raises(ValueError, match=r"--draft-vocab .* must be in \[1, 50\]"):
        draft_ids(np.ones(50, np.int64), size, eos_ids=[1])
