"""jit, library glue and the GPU fixtures, exercised on a small kernel that follows the project's
pattern: static dtype and width, a dynamic row count, a runtime scalar, a registered device op."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tilelang.language as T
import torch

from tk_core import jit
from tk_core.library import device_op
from tk_core.testing import assert_equal, capture_cuda_graph, count_bytes
from tk_core.testing.compile_check import assert_compiles, dynamic_smem_bytes


@jit.kernel
def scale_rows(dtype: str, hidden: int, block_rows: int = 4):
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def main(x: T.Tensor((num_rows, hidden), dtype), y: T.Tensor((num_rows, hidden), dtype), alpha: T.float32):
        with T.Kernel(T.ceildiv(num_rows, block_rows), threads=128) as bx:
            tile = T.alloc_shared((block_rows, hidden), dtype)
            T.copy(x[bx * block_rows, 0], tile)
            for i, j in T.Parallel(block_rows, hidden):
                tile[i, j] = T.cast(T.cast(tile[i, j], "float32") * alpha, dtype)
            T.copy(tile, y[bx * block_rows, 0])

    return main


@device_op("tk_core_test::scale_rows_", mutates_args=("y",))
def scale_rows_op(x: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
    scale_rows.get(x.device, dtype=str(x.dtype).removeprefix("torch."), hidden=x.shape[1])(x, y, alpha)


def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.shape[0]:
        scale_rows_op(x, y, alpha)
    return y


def reference(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return (x.float() * alpha).to(x.dtype)


def test_arch_mapping():
    assert jit.arch_for_capability(9, 0) == "sm_90a"
    assert jit.arch_for_capability(10, 0) == "sm_100a"
    assert jit.arch_for_capability(8, 0) == "sm_80"
    assert jit.arch_of("sm_100a") == "sm_100a"
    with pytest.raises(ValueError, match="must be a CUDA device"):
        jit.arch_of("cpu")


@pytest.mark.compile
@pytest.mark.parametrize("arch", jit.ARCHS)
def test_compiles_without_gpu(arch):
    src = assert_compiles(scale_rows, arch, dtype="bfloat16", hidden=576)
    assert "__global__" in src
    assert dynamic_smem_bytes(scale_rows, arch, dtype="bfloat16", hidden=576) == 4 * 576 * 2


@pytest.mark.compile
def test_dynamic_smem_bytes_of_a_fresh_compile():
    """A fresh compile's lowered device module gives the same size as lowering again."""
    import tilelang

    tilelang.disable_cache()  # a disk-cache hit has no lowered modules
    try:
        kernel = scale_rows.compile("sm_90a", dtype="float32", hidden=320)
    finally:
        tilelang.enable_cache()
    assert kernel.artifact is not None
    assert dynamic_smem_bytes(scale_rows, "sm_90a", kernel, dtype="float32", hidden=320) == 4 * 320 * 4
    assert dynamic_smem_bytes(scale_rows, "sm_90a", dtype="float32", hidden=320) == 4 * 320 * 4


@pytest.mark.compile
def test_precompile_fills_the_cache():
    variants = [(scale_rows, dict(dtype="float32", hidden=h)) for h in (64, 128)]
    assert jit.precompile(variants, archs=("sm_90a",), workers=2, progress=False) == 2
    assert scale_rows.get("sm_90a", dtype="float32", hidden=64) is scale_rows.get("sm_90a", hidden=64, dtype="float32")


def test_get_compiles_different_kernels_in_parallel_and_each_once(monkeypatch):
    factory = jit.kernel(lambda n: None)
    running, peak, calls = [0], [0], []
    lock = threading.Lock()

    def fake_compile(arch, **params):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            calls.append(params["n"])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return ("kernel", params["n"])

    monkeypatch.setattr(factory, "compile", fake_compile)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda n: factory.get("sm_90a", n=n), [1, 2, 1, 2]))
    assert got == [("kernel", 1), ("kernel", 2)] * 2
    assert sorted(calls) == [1, 2] and peak[0] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [0, 1, 7, 4001])
def test_kernel_matches_reference(num_rows):
    x = torch.randn(num_rows, 576, device="cuda", dtype=torch.bfloat16)
    y = scale(x, 1.7)
    assert_equal(y, reference(x, 1.7))
    assert_equal(scale(x, 1.7), y)  # repeat runs are bit-identical


@pytest.mark.gpu
def test_device_op_opcheck_compile_and_graph():
    x = torch.randn(33, 576, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(scale_rows_op.op, (x, torch.empty_like(x), 0.5))
    compiled = torch.compile(scale, fullgraph=True)
    assert_equal(compiled(x, 0.5), reference(x, 0.5))
    y = torch.full_like(x, float("nan"))
    replay, _ = capture_cuda_graph(lambda: scale_rows_op(x, y, 0.25))
    y.fill_(float("nan"))
    x.copy_(torch.randn_like(x))
    replay()
    assert_equal(y, reference(x, 0.25))


@pytest.mark.benchmark
@pytest.mark.parametrize("impl", ["tk", "torch", "torch.compile"])
def test_benchmark_fixture(gpu_benchmark, impl):
    x = torch.randn(8001, 7168, device="cuda", dtype=torch.bfloat16)
    fn = {"tk": scale, "torch": reference, "torch.compile": torch.compile(reference)}[impl]
    y = fn(x, 2.0)
    info = gpu_benchmark(lambda: fn(x, 2.0), kernel="scale_rows", impl=impl, bytes=count_bytes(x, y),
                         num_tokens=8001, hidden=7168)
    assert info["gbps"] > 0 and info["copy_gbps"] > 1000 and info["eager_us"] > 0


def test_blocks_per_sm():
    # 65,536 registers, 2,048 threads and 32 CTAs per SM; never below one CTA
    assert jit.blocks_per_sm(224, 72) == 4 and jit.blocks_per_sm(256, 72) == 3
    assert jit.blocks_per_sm(256, 16) == 8 and jit.blocks_per_sm(32, 16) == 32 and jit.blocks_per_sm(1024, 255) == 1


def two_stagings(shared_aliases=()):
    """A factory whose two shared buffers live one after the other, so that TileLang puts them on the same bytes."""

    @jit.kernel(shared_aliases=shared_aliases)
    def reversed_twice(n: int):
        @T.prim_func
        def main(x: T.Tensor((n,), "float32"), y: T.Tensor((n,), "float32")):
            with T.Kernel(1, threads=n):
                tx = T.get_thread_binding()
                first = T.alloc_shared((n,), "float32")
                second = T.alloc_shared((n,), "float32")
                v = T.alloc_local((1,), "float32")
                first[tx] = x[tx]
                T.sync_threads()
                v[0] = first[n - 1 - tx]
                second[tx] = v[0] * 2
                T.sync_threads()
                y[tx] = second[n - 1 - tx]

        return main

    return reversed_twice


def test_shared_overlaps_of_a_merge_log():
    """The plan TileLang logs (tl.debug_merge_shared_memory_allocations), one block per device function."""
    from tk_core.testing.compile_check import shared_overlaps, shared_plans

    log = """Debug: Memory Allocation Plan for Dynamic Shared Memory:
  Individual Buffer Allocations:
    Buffer: red (Type: float32), Start Offset: 0, Size: 2048 bytes, End Offset: 2047
    Buffer: sinv (Type: float32), Start Offset: 2048, Size: 512 bytes, End Offset: 2559
    Buffer: cnt (Type: int32), Start Offset: 2044, Size: 8 bytes, End Offset: 2051
Debug: End of Memory Allocation Plan.
  Individual Buffer Allocations:
    Buffer: a (Type: float32), Start Offset: 0, Size: 16 bytes, End Offset: 15
    Buffer: b (Type: float32), Start Offset: 16, Size: 16 bytes, End Offset: 31
Debug: End of Memory Allocation Plan."""
    plans = shared_plans(log)
    assert plans == [[("red", 0, 2048), ("sinv", 2048, 512), ("cnt", 2044, 8)], [("a", 0, 16), ("b", 16, 16)]]
    assert shared_overlaps(plans) == {frozenset(("red", "cnt")), frozenset(("sinv", "cnt"))}


@pytest.mark.compile
def test_compile_tier_fails_on_undeclared_shared_aliases():
    """TileLang gives ``second`` the bytes of ``first``; the compile tier accepts that only when declared."""
    with pytest.raises(AssertionError, match=r"\('first', 'second'\)"):
        assert_compiles(two_stagings(), "sm_90a", n=128)
    src = assert_compiles(two_stagings([("second", "first")]), "sm_90a", n=128)
    assert src.count("__syncthreads") == 3  # the sync planner orders the reuse here
