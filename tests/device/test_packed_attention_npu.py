"""torch_npu's fused kernel for packed batches against the per-example reference, on an Ascend NPU (skipped elsewhere).

Tolerance: bf16 inputs; the fused path's relative error against the fp32 CPU result (Frobenius norm, output and the
gradients of q, k, v) within 1.25x the per-example sdpa path's on the same NPU, plus 1e-3. Not run on hardware yet.
"""

import itertools

import pytest
import torch

from raylora.backends import resolve_backend
from raylora.config import BackendArgs
from raylora.data.collate import segment_bounds
from raylora.ops import packed_attention as packed


@pytest.fixture
def npu():
    backend = resolve_backend(BackendArgs())
    if backend.name != "npu":
        pytest.skip("no Ascend NPU on this machine")
    return backend.torch_device()


def _reference(q, k, v, scale, bounds):
    """(B, H, T, D) -> (B, T, H, D): each segment's causal attention on its own, in fp32 on the CPU."""
    flat = [x.float().cpu().transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v)]
    pieces = []
    for s, e in itertools.pairwise(bounds):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in flat)
        group = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        n = e - s
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        pieces.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(pieces).view(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


@pytest.mark.device
def test_the_fused_npu_kernel_matches_each_example_on_its_own(npu, monkeypatch):
    lengths = [[300, 700, 1000, 48], [2048]]  # one row a single example of the compressed mask's full side
    bounds = tuple(segment_bounds(lengths, 2048).tolist())
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, h, 2048, 128, generator=gen) for h in (28, 4, 4)]  # Qwen2.5-7B's heads
    grad = torch.randn(2, 2048, 28, 128, generator=gen)

    def run(fused: bool):
        monkeypatch.setattr(packed, "FUSED_ON", "npu" if fused else "none")
        xs = [x.to(npu, torch.bfloat16).requires_grad_() for x in inputs]
        out, _ = packed.packed_attention(
            None, *xs, None, scaling=128**-0.5, cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32)
        )
        grads = torch.autograd.grad(out, xs, grad.to(npu, torch.bfloat16))
        return [t.float().cpu() for t in (out, *grads)]

    fp32 = [x.requires_grad_() for x in inputs]
    exact = _reference(*fp32, 128**-0.5, bounds)
    truths = [exact.detach(), *torch.autograd.grad(exact, fp32, grad)]
    for fused, portable, truth in zip(run(fused=True), run(fused=False), truths, strict=True):
        error = (fused - truth).norm() / truth.norm()
        assert error <= 1.25 * (portable - truth).norm() / truth.norm() + 1e-3
