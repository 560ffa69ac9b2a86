"""Mixed precision on a CPU that emulates it: one warning line that names the fix."""
import warnings

import pytest
import torch

import draftsmith.train.core.accel as accel


@pytest.mark.parametrize("native", [True, False])
def test_bf16_training_on_a_cpu_without_bf16_kernels_warns_with_the_fix(monkeypatch, native):
    monkeypatch.setattr(accel, "cpu_prepacks", lambda dtype: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accel.check_cpu_precision("bf16", torch.device("cpu"))
        accel.check_cpu_precision("fp32", torch.device("cpu"))
        accel.check_cpu_precision("bf16", torch.device("cuda", 0))
    messages = [str(w.message) for w in caught]
    if native:
        assert messages == []
    else:
        assert len(messages) == 1 and "\n" not in messages[0]
        assert messages[0].startswith("trainer.precision=bf16 on this CPU (")
        assert messages[0].endswith("pass trainer.precision=fp32 model.dtype=float32")
