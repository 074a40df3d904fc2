"""The row-invariant CPU products under planted kernels whose rounding depends on the call's row count.

Which row counts a host's bmm rounds differently is the host's (an AVX2 EPYC: 1-3 rows; an AVX-512
Xeon: 1 row and 16 or more), so the logic is tested on a planted ``torch.bmm`` whose row dependence
is known by construction; what this host's own bmm does is printed, never asserted.
"""

from unittest import mock

import pytest
import torch

from zero_mismatch_plugin.aligned.row_invariant import row_invariant_bmm

_real_bmm = torch.bmm

# Row counts at which the planted kernel moves every output one ulp: the two patterns measured on hosts.
AVX2_EPYC_PATTERN = frozenset({1, 2, 3})
AVX512_XEON_PATTERN = frozenset({1, *range(16, 65)})  # 16+ rows: reached by the 24-row reference


def _planted_bmm(variant_rows=frozenset(), variant_positions=frozenset()):
    """A bmm computing each row alone (so only the plant depends on the call), one ulp up for a call of
    ``variant_rows`` rows, or for the rows at ``variant_positions`` within the call."""

    def bmm(batch1, batch2, out=None):
        rows = [(_real_bmm(batch1[:, m:m + 1].repeat(1, 8, 1), batch2)[:, :1]) for m in range(batch1.shape[1])]
        result = torch.cat(rows, dim=1)
        nudged = torch.nextafter(result, torch.full_like(result, float("inf")))
        if batch1.shape[1] in variant_rows:
            result = nudged
        for position in variant_positions:
            if position < result.shape[1]:
                result[:, position] = nudged[:, position]
        if out is not None:
            out.copy_(result)
            return out
        return result

    return bmm


def _row_dependence(product, heads=2, k=24, n=16, total=24):
    """(rows, start) pairs at which ``product`` gives rows other bits than in one call of ``total`` rows."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(heads, total, k, generator=gen), torch.randn(heads, k, n, generator=gen)
    reference = product(x, w)
    return [(rows, start) for rows in range(1, total + 1) for start in range(0, total - rows + 1, 7)
            if not torch.equal(product(x[:, start:start + rows], w), reference[:, start:start + rows])]


@pytest.mark.parametrize("pattern", [AVX2_EPYC_PATTERN, AVX512_XEON_PATTERN], ids=["avx2-epyc", "avx512-xeon"])
def test_row_invariant_bmm_holds_under_a_row_count_dependent_kernel(pattern):
    with mock.patch("torch.bmm", _planted_bmm(variant_rows=pattern)):
        assert _row_dependence(row_invariant_bmm) == []
        # Negative control: the same check catches the planted kernel itself.
        assert _row_dependence(torch.bmm)


def test_a_kernel_that_rounds_by_row_position_is_caught():
    """Fixed-shape calls assume a row's bits do not depend on its place in the call; a kernel that
    breaks that is detected by the same check (and would fail the bitwise engine tests)."""
    with mock.patch("torch.bmm", _planted_bmm(variant_positions={3})):
        assert _row_dependence(row_invariant_bmm)


def test_the_previous_chunking_fails_on_the_avx2_pattern():
    """Chunks of up to eight rows (a one-row chunk run as two), as before: the 1-3 row remainders that
    an AVX2 EPYC rounds differently break it, which the fixed eight-row shape does not."""

    def variable_chunks(batch1, batch2):
        out = batch1.new_empty(batch1.shape[0], batch1.shape[1], batch2.shape[2])
        for start in range(0, batch1.shape[1], 8):
            chunk = batch1[:, start:start + 8]
            if chunk.shape[1] == 1:
                out[:, start:start + 1] = torch.bmm(torch.cat([chunk, torch.zeros_like(chunk)], 1), batch2)[:, :1]
            else:
                out[:, start:start + chunk.shape[1]] = torch.bmm(chunk, batch2)
        return out

    with mock.patch("torch.bmm", _planted_bmm(variant_rows=AVX2_EPYC_PATTERN)):
        assert _row_dependence(variable_chunks)


def test_this_hosts_bmm_row_dependence_is_reported(capsys):
    """What this host's own bmm does (printed for the host matrix in docs/hosts.md), and that the
    row-invariant product removes it here."""
    dependent = sorted({rows for rows, _ in _row_dependence(torch.bmm, heads=1, k=96, n=256, total=40)})
    with capsys.disabled():
        print(f"\nthis host's torch.bmm (K=96, N=256, fp32): row counts rounding a row differently from 40 rows: "
              f"{dependent or 'none'}")
    assert _row_dependence(row_invariant_bmm, heads=1, k=96, n=256, total=40) == []


@pytest.mark.parametrize("vocab, blocks", [(512, 2), (320, 5), (300, 1)])
@pytest.mark.parametrize("pattern", [AVX2_EPYC_PATTERN, AVX512_XEON_PATTERN], ids=["avx2-epyc", "avx512-xeon"])
def test_the_wide_head_takes_the_vocabulary_in_blocks_and_keeps_a_rows_bits(vocab, blocks, pattern):
    """An fp32 head of bf16 operands: the vocabulary rows in blocks of the widest of 256, 128, 64
    that divides them (else one block), as the batch of each 32-row call; every column where
    ``F.linear`` puts it; a row's logits the same at every row count under the planted kernels."""
    from zero_mismatch_plugin.aligned.row_invariant import row_invariant_wide_head

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 64, generator=gen).bfloat16()
    weight = torch.randn(vocab, 64, generator=gen).bfloat16()
    bias = torch.randn(vocab, generator=gen)
    exact = hidden.double() @ weight.double().t() + bias.double()
    batches = []

    def counted(batch1, batch2, out=None):
        batches.append(batch1.shape[0])
        return _planted_bmm(variant_rows=pattern)(batch1, batch2, out)

    with mock.patch("torch.bmm", counted):
        logits = row_invariant_wide_head(hidden, weight, bias, torch.float32)
        assert set(batches) == {blocks}, batches
        assert logits.dtype == torch.float32 and logits.shape == (40, vocab)
        assert (logits.double() - exact).abs().max() < 1e-4
        for rows in (1, 2, 3, 17, 33):
            assert torch.equal(row_invariant_wide_head(hidden[:rows], weight, bias, torch.float32), logits[:rows]), rows


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 16383, 16384, 16385, 16384 + 64, 40000, 100003])
def test_the_sigmoid_without_autograd_has_the_bits_of_the_differentiable_one(numel):
    """Two code paths (pieces concatenated for autograd, written in place without it) make the same
    elementwise calls: the same bits, at every size and tail length."""
    from zero_mismatch_plugin.aligned.row_invariant import row_invariant_sigmoid

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 6
    with torch.no_grad():
        in_place = row_invariant_sigmoid(x)
    differentiable = row_invariant_sigmoid(x.clone().requires_grad_(True))
    assert differentiable.requires_grad and torch.equal(in_place, differentiable.detach())
    # Rows of a 2-D input keep their bits whatever the rows around them (the point of the function).
    rows = x[: (numel // 7) * 7].view(-1, 7) if numel >= 7 else x.view(1, -1)
    with torch.no_grad():
        assert torch.equal(row_invariant_sigmoid(rows[:1]), row_invariant_sigmoid(rows)[:1])


def _tail_rounds_differently(fn, width=32):
    """``fn`` as torch's CPU loop runs it on a host whose scalar tail rounds differently from its
    vectorised body: the last ``numel % width`` elements of a call one ulp up (planted, any host)."""

    def planted(x):
        out = fn(x).clone()
        flat = out.view(-1)
        tail = flat.numel() % width
        if tail:
            flat[-tail:] = torch.nextafter(flat[-tail:], torch.tensor(float("inf")))
        return out

    return planted


@pytest.mark.parametrize("name", ["exp", "log1p", "sigmoid"])
def test_an_elementwise_function_keeps_a_rows_bits_whatever_the_calls_size(name):
    """``row_invariant_elementwise`` (KDA's decay and softplus, its β and gate sigmoids): a row of 7
    values has the same bits computed alone or among 1-300 other rows, with and without autograd,
    even where the function's scalar tail rounds differently (planted); the planted function alone
    does not. For the sigmoid it is ``row_invariant_sigmoid``'s arithmetic."""
    from zero_mismatch_plugin.aligned.row_invariant import row_invariant_elementwise, row_invariant_sigmoid

    fn = getattr(torch, name)
    planted = _tail_rounds_differently(fn)
    x = torch.randn(301, 7, generator=torch.Generator().manual_seed(3)).abs() * 3
    for kernel in (fn, planted):
        alone = row_invariant_elementwise(kernel, x[:1])
        for rows in (2, 5, 64, 301):
            with torch.no_grad():
                assert torch.equal(row_invariant_elementwise(kernel, x[:rows])[:1], alone), (name, rows)
            grad_path = row_invariant_elementwise(kernel, x[:rows].clone().requires_grad_(True))[:1]
            assert torch.equal(grad_path.detach(), alone), (name, rows)
    assert not all(torch.equal(planted(x[:rows])[:1], planted(x[:1])) for rows in (2, 5, 64, 301))
    if name == "sigmoid":
        assert torch.equal(row_invariant_elementwise(torch.sigmoid, x), row_invariant_sigmoid(x))
