"""CPU kernels whose result for a row does not depend on the call's other rows or on the thread count.

aten and vLLM's CPU kernels pick their code path by the row count or the OpenMP thread count, and the
paths round differently (docs/hosts.md). The aligned ops and the runtime patches call these, and the
vLLM fork patches carry their source (``inspect.getsource``), so each is self-contained: standard
library only, imports inside the body, no plugin names.
"""

from __future__ import annotations


def rotary_on_rows(rotate_in_place, positions, query, key):
    """Run a rotary kernel that reads ``[num_tokens, num_heads * head_size]`` on 3-D inputs.

    ``rotate_in_place(query_rows, key_rows)`` rotates 2-D row tensors in place. A 3-D query or
    key (``[tokens, heads, head_size]``, possibly a view with gaps between heads, as MLA's
    ``q[..., qk_nope_head_dim:]``) is given to it as 2-D rows (a contiguous copy where a view is
    impossible) and the result written back, so the caller's tensors are rotated in place and
    returned. 2-D inputs reach the kernel as they are.
    """
    num_tokens = positions.numel()
    query_rows = query.reshape(num_tokens, -1)
    key_rows = None if key is None else key.reshape(num_tokens, -1)
    rotate_in_place(query_rows, key_rows)
    for tensor, rows in ((query, query_rows), (key, key_rows)):
        if tensor is not None and rows.data_ptr() != tensor.data_ptr():
            tensor.copy_(rows.view(tensor.shape))
    return query, key


def row_invariant_bmm(batch1, batch2, out=None, rows_per_call=8):
    """``torch.bmm`` whose rows do not depend on how many there are, on CPU.

    aten's CPU bmm picks its kernel by the row count, and kernels round a row differently (an
    AVX2 EPYC: 1-3 rows differ from 4+; an AVX-512 Xeon: 1 row and 16+ rows differ from 2-15).
    So every CPU call here has the same shape: ``rows_per_call`` rows (eight unless a caller
    names another; every caller of one product must name the same), the last chunk zero-padded,
    which makes a row's bits independent of the other rows; other devices call ``torch.bmm``.
    """
    import torch

    if batch1.device.type != "cpu" or batch1.dim() != 3:
        return torch.bmm(batch1, batch2) if out is None else torch.bmm(batch1, batch2, out=out)
    if out is None:
        out = batch1.new_empty(batch1.shape[0], batch1.shape[1], batch2.shape[2])
    for start in range(0, batch1.shape[1], rows_per_call):
        chunk = batch1[:, start:start + rows_per_call]
        rows = chunk.shape[1]
        if rows < rows_per_call:
            chunk = torch.cat([chunk, chunk.new_zeros(chunk.shape[0], rows_per_call - rows, chunk.shape[2])], dim=1)
        out[:, start:start + rows] = torch.bmm(chunk, batch2)[:, :rows]
    return out


def row_invariant_sigmoid(x):
    """``torch.sigmoid`` whose bits for an element do not depend on the size of the call, on CPU.

    torch's CPU elementwise loop computes a contiguous tensor in blocks of twice the vector width
    with the vectorised formula and the last ``numel % (2 * width)`` elements with the scalar one,
    which rounds differently (an AVX-512 host: 32-element blocks); a call of 32,768 elements or
    more is also split across threads at offsets that depend on its size. So an [M, n] router or
    gate output got other bits for a row depending on M. Here the flattened input is zero-padded
    to a multiple of 64 elements (two vectors of 32 floats, the widest CPU vector torch uses) and
    computed in pieces of 16,384 elements, so every element goes through the vectorised body of a
    single-threaded loop, whatever the call holds. Elsewhere (GPU) it is ``torch.sigmoid``.
    Differentiable (pad, split and slice are); without autograd the pieces are written into one
    output and only the tail is padded (the same elementwise calls, fewer copies).
    """
    import torch

    if x.device.type != "cpu" or x.numel() == 0:
        return torch.sigmoid(x)
    flat = x.reshape(-1)
    if torch.is_grad_enabled() and x.requires_grad:
        padded = torch.nn.functional.pad(flat, (0, -flat.numel() % 64))
        pieces = [torch.sigmoid(piece) for piece in padded.split(16384)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out[: flat.numel()].reshape(x.shape)
    total = flat.numel()
    body = total - total % 64
    out = torch.empty_like(flat)
    for start in range(0, body, 16384):
        stop = min(start + 16384, body)
        torch.sigmoid(flat[start:stop], out=out[start:stop])
    if body < total:
        out[body:] = torch.sigmoid(torch.nn.functional.pad(flat[body:], (0, 64 - (total - body))))[: total - body]
    return out.reshape(x.shape)


def row_invariant_elementwise(fn, x):
    """``fn(x)`` for an elementwise torch function ``fn`` (``torch.exp``, ``torch.log1p``, ...) whose
    bits for an element do not depend on the size of the call, on CPU: the same zero-padding to a
    multiple of 64 elements and the same pieces of 16,384 as :func:`row_invariant_sigmoid`, for
    the same reason (torch's vectorised body and its scalar tail round transcendental functions
    differently). Differentiable; elsewhere (GPU) it is ``fn(x)``.
    """
    import torch

    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % 64))
    pieces = [fn(piece) for piece in padded.split(16384)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[: flat.numel()].reshape(x.shape)


def on_one_thread(kernel):
    """``kernel`` run with torch's intra-op thread count set to one, then restored.

    For vLLM's CPU MLA decode kernel (``_C.mla_decode_kvcache``), whose output bits depend on
    the OpenMP thread count (1 vs 2 threads: up to 1.2e-7 apart, measured on an AVX-512 Xeon):
    on one thread every process computes the same bits, whatever its own thread count.
    """
    import functools

    import torch

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return kernel(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return kernel(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


def row_invariant_wide_head(hidden_states, weight, bias, head_dtype):
    """vLLM's lm_head in a wider dtype than the model's (``head_dtype``, e.g. an fp32 head of a
    bf16 model), whose rows do not depend on how many there are, on CPU.

    vLLM casts both operands to ``head_dtype`` and calls ``F.linear``; aten's fp32 CPU GEMM picks
    its kernel by the row count and the thread count (an AVX-512 EPYC: 1-3 rows differ from 4+ on
    one thread, 1-3, 5-7 and 9-11 on two), so a lone decoding sequence got other logits than the
    same row in a prefill. Here the same cast operands go through :func:`row_invariant_bmm` in
    calls of 32 rows: every call has one shape and one layout, so a row's bits depend on that row
    alone (and were the same at 1 and 2 threads). 32 rows: a decode step of up to 32 sequences is
    one call; a trainer's thousands of rows read the head once per 32. The weight's rows (the
    vocabulary) are taken in blocks of one width, the widest of 256, 128 and 64 that divides them
    (else one block), as the batch of each call: the blocks are independent GEMMs of one shape that
    spread over the threads, where one [32, vocabulary] GEMM ran on one (an AMD EPYC at 2 threads,
    fp32: 0.60 -> 0.41 ms for a 2048 x 512 head, 190 -> 74 ms for 32000 x 4096; the same bits as
    the one-block call there, at 1 and 2 threads). Elsewhere (GPU) it is vLLM's cast and ``F.linear``.
    """
    import torch

    flat = hidden_states.reshape(-1, hidden_states.shape[-1]).to(head_dtype)
    wide_weight = weight.to(head_dtype)
    if flat.device.type != "cpu":
        logits = torch.nn.functional.linear(flat, wide_weight)
    else:
        vocab, hidden = wide_weight.shape
        block = next((width for width in (256, 128, 64) if vocab % width == 0), vocab)
        blocks = vocab // block
        logits = flat.new_empty(flat.shape[0], vocab)
        # [blocks, hidden, block] views of the weight's transposed blocks; the output written
        # through the matching [blocks, rows, block] view of the logits.
        row_invariant_bmm(flat[None].expand(blocks, -1, -1),
                          wide_weight.view(blocks, block, hidden).transpose(1, 2),
                          out=logits.view(-1, blocks, block).transpose(0, 1), rows_per_call=32)
    if bias is not None:
        logits = logits + bias.to(head_dtype)
    return logits.reshape(*hidden_states.shape[:-1], logits.shape[-1])
