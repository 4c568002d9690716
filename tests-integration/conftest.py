import pytest

# Every flow here needs its packages; skip cleanly where one is not installed.
for name in ("tk_quant", "tk_transpose", "tk_engram"):
    pytest.importorskip(name)
