"""Which failures are this machine's (the row is `inconclusive`, with a remedy) and which are the model's (`fail`)."""

from __future__ import annotations

import pytest
import torch

from pipelines.errors import ENVIRONMENT, environment_cause


def raised(code):
    try:
        exec(code, {})
    except Exception as err:  # noqa: BLE001 - the exception is the subject
        return err
    raise AssertionError("did not raise")


@pytest.mark.parametrize("err, says", [
    (raised("import quantgate_no_such_backend"), "quantgate_no_such_backend cannot be imported here"),
    (RuntimeError("AWQ: CUDA is not available"), "the kernel needs CUDA"),
    (AssertionError("Torch not compiled with CUDA enabled"), "the kernel needs CUDA"),
    (ValueError("GPTQModel 7.6's AWQ needs CUDA; use backend: autoawq (or auto) on a CPU"), "the kernel needs CUDA"),
])
def test_a_missing_library_or_device_is_the_machines(err, says):
    cause = environment_cause(err)
    assert cause["cause"] == ENVIRONMENT and cause["reason"].startswith(says) and cause["remedy"]


@pytest.mark.parametrize("err", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"),
    TimeoutError("quantize gptq3 ran past 3600 s"),
    ValueError("group_size 48 does not divide 64"),
])
def test_a_crash_nan_oom_or_timeout_is_the_models(err):
    assert environment_cause(err) is None
