"""What changes between the transformers releases the package supports (5.17 to 5.24): our code calls them warning-free.

CI runs the whole CPU suite on the floor and on the newest release (.ci/run); these tests pin down the
calls that differ between them.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cudnn_attention.recipes.common import ByteTokenizer, build_model, model_shape  # noqa: E402


def test_gpt_oss_packing_masks_build_without_a_deprecation_warning():
    # 5.24 renamed the mask builders' past_key_values keyword to cache (the old name warns, and goes in 5.40);
    # the recipe's gpt-oss hook passes it by position, which both names accept.
    model = build_model(
        attn_implementation="eager", family="gpt_oss", shape=model_shape(family="gpt_oss", size="tiny"), vocab_size=ByteTokenizer.vocab_size
    )
    ids = torch.arange(3, 15).view(1, -1)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        model(ids, position_ids=position_ids)
