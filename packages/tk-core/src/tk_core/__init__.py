"""tk-core: what every tk kernel package shares.

- ``tk_core.config``: process-wide settings (SM count override, PDL, token alignment, deterministic
  mode, amax clamp floors);
- ``tk_core.checks``: input validation with messages ``"<op>: <arg> must be <expected>, got <actual>"``;
- ``tk_core.formats``: e4m3, e2m1, e5m6 and UE8M0 encodings and the scale rule, bit-exact in PyTorch;
- ``tk_core.layout``: alignment helpers and the scale-factor layouts;
- ``tk_core.jit``: cached TileLang compilation per device arch, ``precompile``;
- ``tk_core.library``: ``device_op``, the torch.library registration used by every package;
- ``tk_core.hostmem``: error counts that kernels write straight into pinned host memory;
- ``tk_core.testing``: numeric checks, generators, GPU timing and the pytest plugin.
"""

from . import checks, config, formats, layout
from .__about__ import __version__

__all__ = ["__version__", "checks", "config", "formats", "layout"]
