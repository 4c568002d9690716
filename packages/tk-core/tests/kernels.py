"""A small TileLang kernel used by tk-core's compile and gpu tiers: ``y = x * alpha`` over a dynamic
number of rows, the pattern every package follows (static block and dtype, dynamic size, runtime scalar)."""

import tilelang.language as T

from tk_core.jit import kernel


@kernel
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
