"""A model whose logits are nan/inf fails sampling with a clear ModelError, not torch's
"probability tensor contains either inf, nan or element < 0" traceback."""

from __future__ import annotations

import pytest
import torch

from dapo_flow.errors import ModelError
from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig


def test_sampling_from_nan_weights_is_a_model_error(tiny_adder_path):
    policy = HFPolicy(tiny_adder_path)
    prompts = [policy.tokenizer.encode("1+2=")]
    with torch.no_grad():
        policy.model.get_output_embeddings().weight.fill_(float("nan"))
    with pytest.raises(ModelError, match=r"(?s)logits are nan/inf.*dtype: float32"):
        policy.generate(prompts, SamplingConfig(n=2, max_tokens=4, temperature=1.0))
