"""tk-transpose: reference on CPU, validation, compile tier and kernel against reference on the GPU."""

import re

import pytest
import torch

from tk_core.jit import ARCHS
from tk_core.testing import assert_equal, capture_cuda_graph
from tk_core.testing.compile_check import assert_compiles
from tk_transpose import SUPPORTED_DTYPES, batched_transpose, reference, transpose
from tk_transpose.transpose import _batched_transpose_op, transpose_kernel, transpose_shared_kernel


def random_tensor(shape, dtype, device="cpu") -> torch.Tensor:
    """Random bits of every pattern (NaNs and signed zeros included): transpose moves bits."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def strided(x: torch.Tensor, row_pad: int, batch_pad: int = 0) -> torch.Tensor:
    """The same values as ``x`` in a buffer with padded rows (and batches)."""
    *b, m, n = x.shape
    buf_shape = (*b[:-1], b[-1] + batch_pad, m, n + row_pad) if b else (m, n + row_pad)
    buf = random_tensor(buf_shape, x.dtype, x.device)
    view = buf[..., :n]
    if b:
        view = view[: b[-1]]
    view.view(torch.uint8).copy_(x.view(torch.uint8))  # byte copy: not every backend copies fp8
    return view


# --- cpu tier -------------------------------------------------------------------------------------


def test_reference_against_hand_made_case():
    x = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert reference.transpose(x).tolist() == [[0, 3], [1, 4], [2, 5]]
    y = reference.batched_transpose(torch.arange(12).view(2, 2, 3).to(torch.uint8))
    assert y[1].tolist() == [[6, 9], [7, 10], [8, 11]] and y.is_contiguous()


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_public_api_on_cpu(dtype):
    x = strided(random_tensor((3, 37, 70), dtype), row_pad=5, batch_pad=1)
    out = batched_transpose(x)
    assert out.shape == (3, 70, 37) and out.is_contiguous()
    size = out.element_size()
    x_bytes = x.contiguous().view(torch.uint8).view(3, 37, 70, size)
    assert torch.equal(out.view(torch.uint8).view(3, 70, 37, size), x_bytes.permute(0, 2, 1, 3))
    assert_equal(transpose(x[1]), out[1])


def test_out_argument_and_empty_inputs():
    x = torch.randn(4, 5)
    out = torch.empty(5, 4)
    assert transpose(x, out=out) is out and torch.equal(out, x.t())  # the caller's tensor, as batched_transpose
    for shape in [(0, 4, 5), (2, 0, 5), (2, 4, 0)]:
        y = batched_transpose(torch.empty(shape))
        assert y.shape == (shape[0], shape[2], shape[1])


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: transpose([1, 2]), TypeError, r"transpose: x must be a torch.Tensor, got list"),
        (lambda: transpose(torch.zeros(2, 2, dtype=torch.int64)), TypeError,
         r"transpose: x must be of dtype float32 or bfloat16 .* got int64"),
        (lambda: transpose(torch.zeros(2, 2, 2)), ValueError, r"transpose: x must be 2-D, got shape \(2, 2, 2\)"),
        (lambda: batched_transpose(torch.zeros(2, 2)), ValueError, r"batched_transpose: x must be 3-D"),
        (lambda: transpose(torch.zeros(4, 6).t()), ValueError, r"transpose: x must be unit-stride in its last"),
        (lambda: transpose(torch.zeros(4, 6), out=torch.zeros(4, 6)), ValueError,
         r"transpose: out must be of shape \(1, 6, 4\)|transpose: out must be of shape \(6, 4\)"),
        (lambda: transpose(torch.zeros(4, 6), out=torch.zeros(6, 4, dtype=torch.bfloat16)), TypeError,
         r"transpose: out must be of dtype float32, got bfloat16"),
        (lambda: transpose(torch.zeros(4, 6), out=torch.zeros(4, 6).t()), ValueError, r"transpose: out must be contiguous"),
        (lambda: (lambda buf: transpose(buf[:, :4], out=buf[2:].view(4, 4)))(torch.zeros(4, 8)), ValueError,
         r"transpose: out must be memory disjoint from x"),  # the kernel would read what it has overwritten
        (lambda: (lambda x: batched_transpose(x, out=x))(torch.zeros(2, 4, 4)), ValueError,
         r"batched_transpose: out must be memory disjoint from x"),
    ],
)
def test_errors(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


# --- compile tier ---------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("elem_bits", [8, 16, 32])
@pytest.mark.parametrize("mode", ["vector", "scalar"])
def test_kernel_compiles(arch, elem_bits, mode):
    src = assert_compiles(transpose_kernel, arch, elem_bits=elem_bits, mode=mode)
    if mode != "scalar":  # 16-byte global loads
        assert re.search(r"= \*\(u?int4\*\)\(x \+", src)
    if mode == "vector":  # register transpose and 16-byte global stores
        assert "tk_st_global_v4(" in src
        assert ("__byte_perm" in src) == (elem_bits < 32)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("elem_bits", [8, 16])
def test_shared_kernel_compiles(arch, elem_bits):
    src = assert_compiles(transpose_shared_kernel, arch, elem_bits=elem_bits)
    # 16-byte cp.async loads, one barrier on each path (interior and edge tiles), 16-byte stores.
    assert "tk_cp_async16(" in src and src.count("__syncthreads()") == 2 and "tk_st_global_v4(" in src
    assert re.search(r"\*\(uint4\*\)\(S \+", src)  # a unit row comes out of shared memory as one vector


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("elem_bits", [8, 16, 32])
def test_shared_kernel_with_shifted_stores_compiles(arch, elem_bits):
    src = assert_compiles(transpose_shared_kernel, arch, elem_bits=elem_bits, shifted_stores=True)
    # The definition and the interior tiles' stores (edge tiles store elements); no aligned-row store is left.
    body = src[src.index("__global__"):]
    assert body.count("tk_store_shifted_row_chunk(") == 1 and "tk_st_global_v4(" not in body


@pytest.mark.compile
@pytest.mark.parametrize("elem_bits", [8, 16, 32])
def test_kernel_compiles_with_8_byte_loads(elem_bits):
    src = assert_compiles(transpose_kernel, "sm_90a", elem_bits=elem_bits, mode="vector", load_bytes=8)
    assert re.search(r"= \*\((uint2|ushort4|int2)\*\)\(x \+", src) and "tk_st_global_v4(" in src  # 8-byte loads


# --- gpu tier -------------------------------------------------------------------------------------

# Interior and edge tiles of both kernels: partial tiles in rows and columns, a partial 16-byte input chunk at a
# row's end (N = 300), output rows not 16-byte aligned (M = 7, 129, 1001, 263: shifted stores), every
# misalignment of a row start (M = 1001).
GPU_SHAPES = [(1, 1, 1), (1, 64, 64), (3, 100, 37), (2, 129, 257), (1, 4032, 576), (8, 256, 7168), (2, 7, 4099),
              (2, 272, 300), (1, 384, 1024), (2, 1001, 520), (3, 263, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_batched_transpose_matches_reference(dtype, shape):
    x = random_tensor(shape, dtype, "cuda")
    out = random_tensor((shape[0], shape[2], shape[1]), dtype, "cuda")  # poisoned
    batched_transpose(x, out=out)
    assert_equal(out, reference.batched_transpose(x))
    again = batched_transpose(x)
    assert_equal(again, out)  # repeat runs are bit-identical


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("row_pad,batch_pad", [(64, 0), (8, 3), (1, 0), (3, 1)])
def test_strided_inputs(dtype, row_pad, batch_pad):
    x = strided(random_tensor((3, 200, 576), dtype, "cuda"), row_pad, batch_pad)
    assert_equal(batched_transpose(x), reference.batched_transpose(x))
    assert_equal(transpose(x[1]), reference.transpose(x[1]))


@pytest.mark.gpu
def test_misaligned_base_pointer_and_size_one_dims():
    buf = random_tensor((1, 300, 513), torch.bfloat16, "cuda")
    x = buf[:, 1:, 1:]  # base address off by one element
    assert_equal(batched_transpose(x), reference.batched_transpose(x))
    col = random_tensor((5, 1000, 1), torch.float32, "cuda")
    assert_equal(batched_transpose(col), reference.batched_transpose(col))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("offset", [1, 3])
def test_misaligned_output_pointer(dtype, offset):
    """``out`` a contiguous view that starts ``offset`` elements after a 16-byte boundary (aligned ``M``)."""
    x = random_tensor((2, 384, 520), dtype, "cuda")
    buf = random_tensor((2 * 520 * 384 + offset,), dtype, "cuda")
    head = buf[:offset].clone()
    out = buf[offset:].view(2, 520, 384)
    batched_transpose(x, out=out)
    assert_equal(out, reference.batched_transpose(x))
    assert_equal(buf[:offset], head)  # the bytes before out are left alone


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 64, 64), (2, 0, 64), (2, 64, 0)])
def test_zero_size(shape):
    assert batched_transpose(torch.empty(shape, device="cuda")).shape == (shape[0], shape[2], shape[1])
    assert transpose(torch.empty(shape[1:], device="cuda")).shape == (shape[2], shape[1])


@pytest.mark.gpu
def test_opcheck_compile_and_cuda_graph():
    x = random_tensor((2, 192, 320), torch.bfloat16, "cuda")
    torch.library.opcheck(_batched_transpose_op.op, (x, torch.empty(2, 320, 192, dtype=x.dtype, device="cuda")))
    compiled = torch.compile(transpose, fullgraph=True)
    assert_equal(compiled(x[0]), reference.transpose(x[0]))
    out = torch.empty(2, 320, 192, dtype=x.dtype, device="cuda")
    replay, _ = capture_cuda_graph(lambda: batched_transpose(x, out=out))
    x.copy_(random_tensor(x.shape, x.dtype, "cuda"))
    out.fill_(float("nan"))
    replay()
    assert_equal(out, reference.batched_transpose(x))
