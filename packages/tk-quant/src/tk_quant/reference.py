"""Plain-PyTorch references of every tk-quant op (CPU or GPU); the golden models the kernels match bit
for bit. Built on ``tk_core.formats`` (conversions, the scale rule) and ``tk_core.layout`` (SF layouts)."""
