"""Which failures are this machine's (the row is `inconclusive`, with a remedy) and which are the model's (`fail`)."""

from __future__ import annotations

import pytest
import torch

from pipelines.core.errors import ENVIRONMENT, environment_cause


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
    (RuntimeError("No GPU found. A GPU is needed for quantization."), "the kernel needs CUDA"),  # transformers' bnb
    (ValueError("GPU is required to run AWQ quantized model."), "the kernel needs CUDA"),  # transformers' AWQ
    (RuntimeError("CUDA error: no kernel image is available for execution on the device"), "the kernel needs CUDA"),
])
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA here, a message saying it is missing is not believed")
def test_a_missing_library_or_device_is_the_machines(err, says):
    cause = environment_cause(err)
    assert cause["cause"] == ENVIRONMENT and cause["reason"].startswith(says) and cause["remedy"]


@pytest.mark.parametrize("err", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"),
    TimeoutError("quantize gptq3 ran past 3600 s"),
    ValueError("group_size 48 does not divide 64"),
    RuntimeError("NaN logits; the fused kernel requires CUDA graphs off"),  # a NaN is the model's, whatever else it says
    raised("import pipelines.no_such_module"),  # quantgate's own package is there: a broken import is a bug
])
def test_a_crash_nan_oom_or_timeout_is_the_models(err):
    assert environment_cause(err) is None
