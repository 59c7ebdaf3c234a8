"""Per-example attention inside packed rows against sdpa over the block-causal mask: loss, LoRA gradients, logits.

Tolerance: fp32 1e-5 (the same sums in another order). Under bf16 autocast, each path's relative error against
the fp32 result (Frobenius norm) may be at most 1.25x the other's plus 1e-3.
"""

import copy
import itertools
import random
import sys

import pytest
import torch

from raylora.config import LoraArgs
from raylora.data.collate import collate_packs, segment_bounds
from raylora.models import attach_lora, randomise_lora, tiny_model
from raylora.ops import packed_attention as packed
from raylora.train.lm import LossModel

WIDTH = 24


def _rows() -> list[dict]:
    """Two pack rows: three examples and two tokens of padding; two examples and seven of padding."""
    gen = random.Random(0)
    rows = []
    for lens in ([9, 6, 7], [11, 6]):
        ids = [gen.randrange(3, 200) for _ in range(sum(lens))]
        labels = [t if gen.random() > 0.3 else -100 for t in ids]
        rows.append({
            "input_ids": ids, "labels": labels, "position_ids": [i for n in lens for i in range(n)],
            "seq_lens": lens, "num_tokens": sum(lens),
        })  # fmt: skip
    return rows


def _pair(chunked: bool):
    model = attach_lora(tiny_model("llama"), LoraArgs(rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"]))
    randomise_lora(model, 3, 0.1)
    ours = copy.deepcopy(model)
    assert packed.use_packed_attention(ours.get_base_model())
    assert ours.get_base_model().config._attn_implementation == packed.NAME
    assert model.get_base_model().config._attn_implementation == "sdpa"
    return LossModel(model, chunked), LossModel(ours, chunked)


def _run(loss_model, batch: dict, autocast: bool = False):
    loss_model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_model(**batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in loss_model.named_parameters() if p.requires_grad}
    return loss.detach().float(), grads


def test_segment_bounds_cover_each_example_then_the_row_s_padding():
    assert segment_bounds([[9, 6, 7], [11, 6]], WIDTH).tolist() == [0, 9, 15, 22, 24, 35, 41, 48]
    assert segment_bounds([[24], [10, 14]], WIDTH).tolist() == [0, 24, 34, 48]
    # padding in segments of at most PAD_SEGMENT tokens
    assert segment_bounds([[100], [200]], 200).tolist() == [0, 100, 164, 200, 400]
    assert collate_packs(_rows(), 0, width=WIDTH)["cu_seq_lens"].dtype == torch.int32


@pytest.mark.parametrize("chunked", [True, False])
def test_packed_attention_equals_the_block_mask_in_loss_and_gradients(chunked):
    reference, ours = _pair(chunked)
    batch = collate_packs(_rows(), 0, width=WIDTH)
    exact = _run(reference, batch)
    got = _run(ours, batch)
    torch.testing.assert_close(got[0], exact[0], atol=1e-5, rtol=1e-5)
    assert got[1].keys() == exact[1].keys() and len(exact[1]) > 0
    for name in exact[1]:
        torch.testing.assert_close(got[1][name], exact[1][name], atol=1e-5, rtol=1e-5, msg=name)

    def errors(result):
        pairs = [(result[0], exact[0])] + [(result[1][n], exact[1][n]) for n in exact[1]]
        return [((a - b).norm() / b.norm()).item() for a, b in pairs]

    mine, theirs = errors(_run(ours, batch, autocast=True)), errors(_run(reference, batch, autocast=True))
    assert all(m <= 1.25 * t + 1e-3 for m, t in zip(mine, theirs, strict=True)), (mine, theirs)


def test_padding_cut_into_short_segments_changes_no_loss_or_gradient(monkeypatch):
    reference, ours = _pair(chunked=True)
    whole = collate_packs(_rows(), 0, width=WIDTH)
    exact = _run(reference, whole)
    monkeypatch.setattr("raylora.data.collate.PAD_SEGMENT", 1)
    cut = collate_packs(_rows(), 0, width=WIDTH)
    assert len(cut["cu_seq_lens"]) == len(whole["cu_seq_lens"]) + 7  # the 2 + 7 padding tokens, one segment each
    got = _run(ours, cut)
    torch.testing.assert_close(got[0], exact[0], atol=1e-5, rtol=1e-5)
    for name in exact[1]:
        torch.testing.assert_close(got[1][name], exact[1][name], atol=1e-5, rtol=1e-5, msg=name)


def test_each_example_attends_causally_on_its_own(monkeypatch):
    _, ours = _pair(chunked=True)
    calls = []
    real = packed.CausalAttention.apply

    def recording(q, k, v, scale, bounds, shared):
        calls.append([e - s for s, e in itertools.pairwise(bounds)])
        return real(q, k, v, scale, bounds, shared)

    monkeypatch.setattr(packed.CausalAttention, "apply", recording)
    with torch.no_grad():
        ours(**collate_packs(_rows(), 0, width=WIDTH))
    layers = ours.model.get_base_model().config.num_hidden_layers
    assert calls == [[9, 6, 7, 2, 11, 6, 7]] * layers  # one call per layer for the whole batch


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 1, 13, 21],  # one segment a single token
        [3, packed.SPLIT_FROM - 1, packed.SPLIT_FROM, 300, packed.OURS_UP_TO],  # the long ones in query blocks
    ],
)
def test_one_call_over_many_segments_equals_each_segment_on_its_own(lengths):
    """fp32 at 1e-5: :class:`CausalAttention` over segments of a flat sequence gives each segment the plain
    formula's output and gradients, with nothing crossing a boundary; examples from SPLIT_FROM tokens up run as
    query blocks, each scoring only the keys up to its last query."""
    bounds = tuple(itertools.accumulate(lengths, initial=0))
    gen = torch.Generator().manual_seed(len(lengths))
    inputs = [torch.randn(h, bounds[-1], 16, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    grad = torch.randn(4, bounds[-1], 16, generator=gen)
    out = packed.CausalAttention.apply(*inputs, 0.3, bounds)
    got = torch.autograd.grad(out, inputs, grad)
    pieces = [_causal_reference(*(x[:, s:e] for x in inputs), 0.3) for s, e in itertools.pairwise(bounds)]
    expected = torch.cat(pieces, dim=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(got, torch.autograd.grad(expected, inputs, grad), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, packed.SPLIT_FROM - 1, packed.SPLIT_FROM, 300, packed.OURS_UP_TO])
def test_query_blocks_cover_an_example_in_near_equal_blocks(n):
    blocks = packed.query_blocks(7, 7 + n)
    assert blocks[0][0] == 7 and blocks[-1][1] == 7 + n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [e - s for s, e in blocks]
    if n < packed.SPLIT_FROM:
        assert sizes == [n]
    else:
        assert len(sizes) == -(-n // packed.QUERY_BLOCK) and max(sizes) - min(sizes) <= 1


def test_a_block_s_mask_is_its_rows_of_the_example_s_causal_mask():
    full = packed._causal_bias(10, 10, 1, torch.float32, torch.device("cpu"))
    assert torch.equal(
        full, torch.zeros(10, 10).masked_fill_(torch.ones(10, 10, dtype=torch.bool).triu_(1), -torch.inf)
    )
    block = packed._causal_bias(3, 7, 2, torch.float32, torch.device("cpu"))  # queries 4..6 over keys 0..6
    assert torch.equal(block, full[4:7, :7].repeat(2, 1))


def test_a_pack_with_an_example_past_our_kernel_goes_example_by_example(monkeypatch):
    """One example longer than OURS_UP_TO: that example takes sdpa, the others our kernel, one call each."""
    lengths = [3, packed.OURS_UP_TO + 2, 4]
    bounds = torch.tensor([0, 3, 3 + lengths[1], sum(lengths)])
    seen = []
    real = packed.attend
    monkeypatch.setattr(packed, "attend", lambda q, k, v, s, p: seen.append(q.shape[1]) or real(q, k, v, s, p))
    gen = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(1, h, sum(lengths), 8, generator=gen) for h in (4, 2, 2))
    out, _ = packed.packed_attention(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=bounds)
    assert seen == lengths
    flat = [x[0] for x in (query, key, value)]
    pieces = [_causal_reference(*(x[:, s:e] for x in flat), 0.3) for s, e in itertools.pairwise(bounds.tolist())]
    torch.testing.assert_close(out[0], torch.cat(pieces, dim=1).transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_without_boundaries_the_model_answers_as_with_sdpa():
    reference, ours = _pair(chunked=False)
    ids = torch.tensor([[5, 17, 33, 8, 90, 4]])
    with torch.no_grad():
        torch.testing.assert_close(ours.model(input_ids=ids).logits, reference.model(input_ids=ids).logits)
        kept = dict(max_new_tokens=5, do_sample=False)
        assert torch.equal(ours.model.generate(input_ids=ids, **kept), reference.model.generate(input_ids=ids, **kept))


@pytest.mark.parametrize("path", ["ours", "example by example"])
def test_a_shared_prefix_is_read_before_the_segment_s_own_tokens(monkeypatch, path):
    """A pair's second sequence reads the first ``shared`` tokens of the sequence before it (its prompt), then its own
    causally: output and gradients equal causal attention over prompt + own tokens, the own rows taken (fp32, 1e-5).
    The long segments' queries go in blocks (our kernel), and the example-by-example path takes sdpa's masked call."""
    if path != "ours":
        monkeypatch.setattr(packed, "OURS_UP_TO", 8)
    lengths, shared = [20, packed.SPLIT_FROM + 44, 7, 5, 9], [0, 19, 0, 6, 0]
    bounds = torch.tensor([0, *itertools.accumulate(lengths)])
    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randn(1, h, sum(lengths), 8, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    out, _ = packed.packed_attention(None, *inputs, None, scaling=0.3, cu_seq_lens_q=bounds,
                                     shared_prefix=torch.tensor(shared, dtype=torch.int32))  # fmt: skip
    grad = torch.randn(out.shape, generator=gen)
    ours = torch.autograd.grad(out, inputs, grad)

    flat = [x[0] for x in inputs]
    pieces, starts = [], bounds.tolist()
    for j, (s, e) in enumerate(itertools.pairwise(starts)):
        keys = list(range(starts[j - 1], starts[j - 1] + shared[j])) + list(range(s, e)) if shared[j] else range(s, e)
        whole = _causal_reference(flat[0][:, keys], flat[1][:, keys], flat[2][:, keys], 0.3)
        pieces.append(whole[:, -(e - s) :])
    reference = torch.cat(pieces, dim=1).transpose(0, 1)
    torch.testing.assert_close(out[0], reference, atol=1e-5, rtol=1e-5)
    expected = torch.autograd.grad(reference, inputs, grad[0])
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_mask_of_a_pack_of_pairs_lets_the_second_sequence_read_the_shared_prompt():
    from raylora.data.collate import block_causal_mask, segment_shared

    allowed = block_causal_mask([[4, 3]], 8, shared=[[0, 3]])[0, 0] == 0
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[:4, :4] = torch.ones(4, 4, dtype=torch.bool).tril()
    expected[4:7, :3] = True  # the prompt but its last token, which begins the second sequence
    expected[4:7, 4:7] = torch.ones(3, 3, dtype=torch.bool).tril()
    expected[7, 7] = True  # padding reads itself
    assert torch.equal(allowed, expected)
    assert segment_shared([[4, 3], [2]], [[0, 3], [0]], 8).tolist() == [0, 3, 0, 0, 0]


def _causal_reference(q, k, v, scale):
    group = q.shape[0] // k.shape[0]
    scores = (q @ k.repeat_interleave(group, 0).transpose(1, 2)) * scale
    n = q.shape[1]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v.repeat_interleave(group, 0)


@pytest.mark.parametrize("n", [1, packed.FLASH_FROM - 1, packed.FLASH_FROM + 40, packed.OURS_UP_TO + 1])
@pytest.mark.parametrize("kernel", ["ours", "sdpa"])
def test_each_kernel_gives_each_example_its_causal_attention_and_gradients(kernel, n):
    """fp32 at 1e-5: our CPU kernel (:class:`CausalAttention`) and sdpa's two paths against the plain formula."""
    attend = packed.attend if kernel == "ours" else packed.sdpa_attend
    gen = torch.Generator().manual_seed(n)
    inputs = [torch.randn(h, n, 16, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    grad = torch.randn(4, n, 16, generator=gen)
    out = attend(*inputs, 0.3)
    ours = torch.autograd.grad(out, inputs, grad)
    expected = _causal_reference(*inputs, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(ours, torch.autograd.grad(expected, inputs, grad), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_our_kernel_in_bf16_errs_about_as_much_as_sdpa_s():
    """bf16 inputs, 300 tokens, SmolLM2's head layout (9 query heads over 3 key heads of 64): our kernel's output
    and gradients are within 1.25x sdpa's relative error (plus 1e-3) of the fp32 result."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(h, 300, 64, generator=gen) for h in (9, 3, 3)]
    grad = torch.randn(9, 300, 64, generator=gen)

    def run(attend, dtype):
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        out = attend(*xs, 0.125)
        return [out.float(), *(g.float() for g in torch.autograd.grad(out, xs, grad.to(dtype)))]

    exact = run(_causal_reference, torch.float32)
    for ours, sdpa, truth in zip(
        run(packed.attend, torch.bfloat16), run(packed.sdpa_attend, torch.bfloat16), exact, strict=True
    ):
        error = (ours - truth).norm() / truth.norm()
        assert error <= 1.25 * (sdpa - truth).norm() / truth.norm() + 1e-3


def test_examples_longer_than_our_kernel_takes_go_to_sdpa_s_flash_kernel(monkeypatch):
    """Our kernel holds each example's probabilities for the backward; past OURS_UP_TO tokens the CPU takes
    sdpa's flash path, which holds one value per row."""
    used = []
    monkeypatch.setattr(packed.CausalAttention, "apply", lambda *args: used.append("ours") or _causal_reference(*args))
    for n in (packed.OURS_UP_TO, packed.OURS_UP_TO + 1):
        q, k, v = (torch.randn(h, n, 8) for h in (4, 2, 2))
        torch.testing.assert_close(packed.attend(q, k, v, 0.3), _causal_reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)
    assert used == ["ours"]


def _fake_torch_npu(monkeypatch) -> list[dict]:
    """A torch_npu whose ``npu_fusion_attention`` records its arguments and answers, for the TND layout, what the
    kernel computes from them: each segment its causal attention, found from the cumulative ``actual_seq_qlen``
    alone (the plain formula on CPU). Returns the record."""
    calls = []

    def npu_fusion_attention(query, key, value, head_num, input_layout, *, atten_mask, scale, sparse_mode,
                             actual_seq_qlen, actual_seq_kvlen):  # fmt: skip
        calls.append(dict(query=query, key=key, value=value, head_num=head_num, input_layout=input_layout,
                          atten_mask=atten_mask, scale=scale, sparse_mode=sparse_mode,
                          actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen))  # fmt: skip
        ends = [0, *actual_seq_qlen]
        pieces = [
            _causal_reference(*(x[s:e].transpose(0, 1) for x in (query, key, value)), scale).transpose(0, 1)
            for s, e in itertools.pairwise(ends)
        ]
        return torch.cat(pieces), None, None, None, 0, 0, 0  # attention_out, softmax max / sum, reserved, dropout

    module = type(sys)("torch_npu")
    module.npu_fusion_attention = npu_fusion_attention
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return calls


def test_the_npu_kernel_gets_the_pack_s_cumulative_ends_and_causal_mode(monkeypatch):
    """torch_npu's documented varlen call: TND, ``actual_seq_qlen`` / ``actual_seq_kvlen`` the segments' cumulative
    ends without the leading 0, sparse_mode 3 with the compressed 2048 x 2048 causal mask, fewer key/value heads
    passed as they are (GQA)."""
    calls = _fake_torch_npu(monkeypatch)
    bounds = tuple(segment_bounds([[9, 6, 7], [11, 6]], WIDTH).tolist())
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(bounds[-1], h, 8, generator=gen) for h in (4, 2, 2))
    out = packed.npu_fusion_attention(q, k, v, 0.3, bounds)
    (call,) = calls
    assert call["actual_seq_qlen"] == call["actual_seq_kvlen"] == [9, 15, 22, 24, 35, 41, 48]
    assert (call["input_layout"], call["head_num"], call["scale"], call["sparse_mode"]) == ("TND", 4, 0.3, 3)
    assert call["key"].shape == (48, 2, 8) and call["value"].shape == (48, 2, 8)
    mask = call["atten_mask"]
    assert mask.dtype == torch.bool and torch.equal(mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    expected = [_causal_reference(*(x[s:e].transpose(0, 1) for x in (q, k, v)), 0.3) for s, e in
                itertools.pairwise(bounds)]  # fmt: skip
    torch.testing.assert_close(out, torch.cat(expected, dim=1).transpose(0, 1), atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed.npu_fusion_attention(q, k, v, 0.3, bounds)
    assert {calls[-1][name].dtype for name in ("query", "key", "value")} == {torch.bfloat16}  # one dtype, autocast's


def test_a_packed_batch_on_the_npu_takes_one_fused_call_per_layer_and_keeps_loss_and_gradients(monkeypatch):
    """The whole path on the tiny model with the kernel mocked (device type ``cpu`` standing for ``npu``): one call per
    layer, and the loss and LoRA gradients of the block-mask reference (fp32, 1e-5)."""
    calls = _fake_torch_npu(monkeypatch)
    reference, ours = _pair(chunked=True)
    batch = collate_packs(_rows(), 0, width=WIDTH)
    exact = _run(reference, batch)
    monkeypatch.setattr(packed, "FUSED_ON", "cpu")
    got = _run(ours, batch)
    assert len(calls) == ours.model.get_base_model().config.num_hidden_layers
    torch.testing.assert_close(got[0], exact[0], atol=1e-5, rtol=1e-5)
    for name in exact[1]:
        torch.testing.assert_close(got[1][name], exact[1][name], atol=1e-5, rtol=1e-5, msg=name)


def test_more_segments_than_the_npu_kernel_takes_go_example_by_example(monkeypatch):
    calls = _fake_torch_npu(monkeypatch)
    monkeypatch.setattr(packed, "FUSED_ON", "cpu")
    monkeypatch.setattr(packed, "FUSED_MAX_SEGMENTS", 2)
    query, key, value = (torch.randn(1, h, 10, 8) for h in (4, 2, 2))
    packed.packed_attention(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=torch.tensor([0, 3, 6, 10]))
    assert calls == []
    packed.packed_attention(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=torch.tensor([0, 6, 10]))
    assert len(calls) == 1


def test_a_batch_of_pairs_on_the_npu_goes_example_by_example(monkeypatch):
    """The fused kernel's TND layout cannot say that a segment reads another's prompt: pairs skip it."""
    calls = _fake_torch_npu(monkeypatch)
    monkeypatch.setattr(packed, "FUSED_ON", "cpu")
    query, key, value = (torch.randn(1, h, 10, 8) for h in (4, 2, 2))
    bounds = torch.tensor([0, 6, 10])
    packed.packed_attention(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=bounds,
                            shared_prefix=torch.tensor([0, 5], dtype=torch.int32))  # fmt: skip
    assert calls == []
    packed.packed_attention(None, query, key, value, None, scaling=0.3, cu_seq_lens_q=bounds,
                            shared_prefix=torch.tensor([0, 0], dtype=torch.int32))  # fmt: skip
    assert len(calls) == 1
