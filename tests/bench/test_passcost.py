import pytest
import torch

from splitlm.bench.passcost import measure
from splitlm.model.synthetic import QWEN2_SMALL


@pytest.mark.parametrize("context", [0, 16])
def test_pass_cost_rows_per_size_also_from_an_empty_cache(context):
    rows = measure(QWEN2_SMALL, torch.device("cpu"), torch.float32, [1, 3], context=context, reps=1)
    assert [(r.tokens, r.context) for r in rows] == [(1, context), (3, context)]
    assert all(r.ms > 0 for r in rows)
