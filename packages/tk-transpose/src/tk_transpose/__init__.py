"""tk-transpose: transpose of the last two dimensions at the copy-bandwidth limit."""

from .__about__ import __version__
from .transpose import SUPPORTED_DTYPES, batched_transpose, transpose

__all__ = ["SUPPORTED_DTYPES", "__version__", "batched_transpose", "transpose"]
