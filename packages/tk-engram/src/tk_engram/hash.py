"""``engram_hash``: multiply-XOR n-gram hashes of token ids into rows of the concatenated Engram tables.

Math, for layer l, token t (N = max n-gram size, J = tables per n-gram order)::

    h = 0
    for i in 0..N-1:
        h = h XOR (int64(ids[t, i]) * mult[l, i])        # int64 product, wrapping
        if i >= 1:                                       # the n-gram of order i+1 (ids 0..i)
            for j in 0..J-1:
                out[l, t, (i-1)*J + j] = int32(floormod(h, vocab[l, i-1, j]) + offsets[l, (i-1)*J + j])

``floormod`` is Python's ``%`` (result has the sign of the divisor, so it lies in [0, vocab) for the
positive vocab sizes used in practice). ``reference.make_offsets`` builds the offsets (exclusive prefix
sums of the table sizes).

Shapes and dtypes: ``ngram_token_ids`` int32 (T, N), N >= 2, inner-contiguous; ``multipliers`` int64
(L, N); ``vocab_sizes`` int32 (L, N-1, J); ``offsets`` int32 (L, (N-1)*J). Output int32
(L, T, (N-1)*J), contiguous, on the ids' device. T = 0 gives an empty output without a launch.
Vocab sizes must be positive: on CPU a size <= 0 raises ``ValueError``; on CUDA they are not checked (reading
them back would cost a host sync), and a size <= 0 gives undefined row ids.

``image_token_mask`` (optional, bool (T,), as in TileKernels 2.1.0): masked (image) tokens get -1 in every
output column of every layer.

Kernel: grid (ceil(T/128), L), one thread per token and layer, everything in registers; N, J, L and
whether a mask is given are compile-time, T and the ids' row stride are runtime. Deterministic and
bit-exact against the reference.
"""

import tilelang.language as T
import torch

from tk_core import checks
from tk_core.jit import kernel
from tk_core.library import device_op

from . import reference

OP = "engram_hash"
THREADS = 128


@kernel
def engram_hash_kernel(num_layers: int, max_ngram: int, tables: int, masked: bool = False):
    N, L, J = max_ngram, num_layers, tables
    C = (N - 1) * J
    nt = T.dynamic("num_tokens")
    s0 = T.dynamic("ids_stride0")

    @T.macro
    def body(Ids, Mult, Vocab, Offsets, Out, Mask):
        with T.Kernel(T.ceildiv(nt, THREADS), L, threads=THREADS) as (bx, layer):
            tx = T.get_thread_binding()
            t = bx * THREADS + tx
            hv = T.alloc_var("uint64")
            hs = T.alloc_var("int64")
            m = T.alloc_var("int64")
            vs = T.alloc_var("int64")
            if t < nt:
                hv = T.uint64(0)
                for i in T.unroll(N):
                    # unsigned product: wraps modulo 2^64 (defined), bit-identical to torch's int64 product
                    hv = T.bitwise_xor(
                        hv, T.cast(T.cast(Ids[t, i], "int64"), "uint64") * T.cast(Mult[layer, i], "uint64")
                    )
                    if i >= 1:
                        hs = T.cast(hv, "int64")
                        for j in T.unroll(J):
                            vs = T.cast(Vocab[layer, i - 1, j], "int64")
                            m = T.truncmod(hs, vs)
                            # floor-mod: move a non-zero remainder to the divisor's sign
                            m = T.if_then_else((m != 0) and ((m < 0) != (vs < 0)), m + vs, m)
                            Out[layer, t, (i - 1) * J + j] = T.cast(
                                m + T.cast(Offsets[layer, (i - 1) * J + j], "int64"), "int32"
                            )
                if masked:
                    if Mask[t] != 0:
                        for c in T.unroll(C):
                            Out[layer, t, c] = T.int32(-1)

    if masked:

        @T.prim_func
        def hash_masked(
            Ids: T.StridedTensor((nt, N), (s0, 1), "int32"),
            Mult: T.Tensor((L, N), "int64"),
            Vocab: T.Tensor((L, N - 1, J), "int32"),
            Offsets: T.Tensor((L, C), "int32"),
            Out: T.Tensor((L, nt, C), "int32"),
            Mask: T.Tensor((nt,), "uint8"),
        ):
            body(Ids, Mult, Vocab, Offsets, Out, Mask)

        return hash_masked

    @T.prim_func
    def hash_(
        Ids: T.StridedTensor((nt, N), (s0, 1), "int32"),
        Mult: T.Tensor((L, N), "int64"),
        Vocab: T.Tensor((L, N - 1, J), "int32"),
        Offsets: T.Tensor((L, C), "int32"),
        Out: T.Tensor((L, nt, C), "int32"),
    ):
        body(Ids, Mult, Vocab, Offsets, Out, None)

    return hash_


@device_op("tk_engram::engram_hash", mutates_args=("out",))
def _engram_hash_op(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    image_token_mask: torch.Tensor | None = None,
) -> None:
    L, N = multipliers.shape
    J = vocab_sizes.shape[2]
    masked = image_token_mask is not None
    kern = engram_hash_kernel.get(out.device, num_layers=L, max_ngram=N, tables=J, masked=masked)
    if masked:
        kern(ngram_token_ids, multipliers, vocab_sizes, offsets, out, image_token_mask.view(torch.uint8))
    else:
        kern(ngram_token_ids, multipliers, vocab_sizes, offsets, out)


def _check(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask=None):
    checks.check_dtype(OP, "ngram_token_ids", ngram_token_ids, torch.int32)
    checks.check_dtype(OP, "multipliers", multipliers, torch.int64)
    checks.check_dtype(OP, "vocab_sizes", vocab_sizes, torch.int32)
    checks.check_dtype(OP, "offsets", offsets, torch.int32)
    checks.check_ndim(OP, "ngram_token_ids", ngram_token_ids, 2)
    N = ngram_token_ids.shape[1]
    if N < 2:
        checks.fail(OP, "ngram_token_ids", "of shape (T, N) with N >= 2", f"shape {tuple(ngram_token_ids.shape)}")
    checks.check_ndim(OP, "multipliers", multipliers, 2)
    L = multipliers.shape[0]
    checks.check_shape(OP, "multipliers", multipliers, (L, N))
    checks.check_grid_extent(OP, "multipliers", L, "layers (dimension 0)", f"shape {tuple(multipliers.shape)}")
    checks.check_ndim(OP, "vocab_sizes", vocab_sizes, 3)
    J = vocab_sizes.shape[2]
    checks.check_shape(OP, "vocab_sizes", vocab_sizes, (L, N - 1, J))
    checks.check_shape(OP, "offsets", offsets, (L, (N - 1) * J))
    for name, t in (("multipliers", multipliers), ("vocab_sizes", vocab_sizes), ("offsets", offsets)):
        checks.check_same_device(OP, name, t, ngram_token_ids.device)
    if image_token_mask is not None:
        checks.check_dtype(OP, "image_token_mask", image_token_mask, torch.bool)
        checks.check_shape(OP, "image_token_mask", image_token_mask, (ngram_token_ids.shape[0],))
        checks.check_same_device(OP, "image_token_mask", image_token_mask, ngram_token_ids.device)
    return L, N, J


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    image_token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Engram n-gram hash: int32 (L, T, (N-1)*J) row ids of the concatenated tables (see module doc);
    tokens flagged in the optional bool (T,) ``image_token_mask`` get -1 everywhere.

    Raises ``TypeError`` for wrong dtypes and ``ValueError`` for wrong shapes or devices, and on CPU for vocab
    sizes <= 0 (not checked on CUDA: module docstring).
    """
    L, N, J = _check(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask)
    if ngram_token_ids.device.type != "cuda":
        if vocab_sizes.numel() and vocab_sizes.min() <= 0:  # a zero size divides by zero, a negative one wraps
            checks.fail(OP, "vocab_sizes", "positive", f"minimum {int(vocab_sizes.min())}")
        return reference.engram_hash_ref(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask)
    num_tokens = ngram_token_ids.shape[0]
    out = torch.empty((L, num_tokens, (N - 1) * J), dtype=torch.int32, device=ngram_token_ids.device)
    if num_tokens == 0 or out.numel() == 0:
        return out
    if ngram_token_ids.stride(1) != 1:
        ngram_token_ids = ngram_token_ids.contiguous()
    if image_token_mask is not None:
        image_token_mask = image_token_mask.contiguous()
    _engram_hash_op(
        ngram_token_ids, multipliers.contiguous(), vocab_sizes.contiguous(), offsets.contiguous(), out,
        image_token_mask,
    )
    return out
