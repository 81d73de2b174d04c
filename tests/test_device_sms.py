"""kernels/device_sms.py: the SM count the launch plans size their grids by."""

from __future__ import annotations

import torch

from kvloom.kernels.device_sms import INTERPRETED_SMS, sm_count


def test_cpu_tensors_get_the_interpreters_count():
    assert sm_count(torch.device("cpu")) == INTERPRETED_SMS
