import pytest
import torch

from raylora.backends import resolve_backend
from raylora.config import BackendArgs


@pytest.fixture
def accelerator():
    backend = resolve_backend(BackendArgs())
    if backend.name == "cpu":
        pytest.skip("no NPU or GPU on this machine")
    return backend


def test_autocast_matmul_runs_on_the_detected_device(accelerator):
    device = accelerator.torch_device()
    a = torch.randn(256, 256, device=device)
    with torch.autocast(accelerator.name, dtype=accelerator.amp_dtype, enabled=accelerator.amp_dtype is not None):
        out = a @ a
    accelerator.synchronize()
    torch.testing.assert_close(out.float().cpu(), a.cpu() @ a.cpu(), atol=0.5, rtol=0.05)
    assert accelerator.peak_memory_mb() > 0
