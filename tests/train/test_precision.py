"""Mixed precision on a CPU that emulates it: one warning line that names the fix."""
import pytest
import torch

import draftsmith.train.core.accel as accel


@pytest.mark.parametrize("native", [True, False])
def test_bf16_training_on_a_cpu_without_bf16_kernels_warns_with_the_fix(monkeypatch, native):
    monkeypatch.setattr(accel, "cpu_prepacks", lambda dtype: native)
    assert accel.emulated_precision("fp32", torch.device("cpu")) is None
    assert accel.emulated_precision("bf16", torch.device("cuda", 0)) is None
    message = accel.emulated_precision("bf16", torch.device("cpu"))
    if native:
        assert message is None
    else:
        assert "\n" not in message and message.startswith("warning: trainer.precision=bf16 on this CPU (")
        assert message.endswith("pass trainer.precision=fp32 model.dtype=float32")
