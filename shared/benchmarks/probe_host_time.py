"""Host time per eager call of some public ops, and where it goes (not a pytest file; needs a GPU).

    python3 shared/benchmarks/probe_host_time.py [--profile]

Per op: microseconds of host time per call (N calls back to back, small inputs so that the GPU keeps up, then one
sync), the kernel's device time, and for the lossless cast a breakdown: TileLang's ``JITKernel.__call__`` and the
compiled host function it wraps, called directly with the same arguments, ``torch.empty``, the kernel cache look-up.
With ``--profile``, then cProfile of the eager calls (top functions by own time). Host times move by up to 2x
between machines and runs (``torch.empty`` took 4.3-9 us on the H200's host): compare within one run."""

import cProfile
import pstats
import sys
import time

import torch

N = 1000


def host_us(fn, n=N, rounds=5):
    """The least, over ``rounds``, of the mean host time of ``n`` calls (the host's clock and caches settle)."""
    best = float("inf")
    for _ in range(rounds):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / n * 1e6)
    return best


def main():
    import tk_quant
    from tk_core import config, hostmem
    from tk_core.jit import arch_of
    from tk_core.testing.bench import device_time_us
    from tk_quant import reference
    from tk_quant.per_block_cast_lossless import (
        PASSES,
        _sf_flat,
        _tile,
        default_min_blocks,
        num_ctas,
        per_block_cast_lossless_kernel,
    )

    dev = torch.device("cuda")
    t, h = 64, 7168
    xb = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    xq = reference.cast(torch.randn(t, h, device=dev), "e2m1", (1, 32), round_sf=True)
    xb128 = torch.randn(128, h, device=dev, dtype=torch.bfloat16)
    q8 = tk_quant.per_token_cast(xb, "e4m3", 128)
    pos = torch.arange(128, device=dev, dtype=torch.int32) % t
    ops = {
        "lossless check=False": lambda: tk_quant.per_block_cast_lossless(xq, "e4m3", (1, 32), (1, 128), check=False),
        "lossless check=True": lambda: tk_quant.per_block_cast_lossless(xq, "e4m3", (1, 32), (1, 128)),
        "per_token_cast e4m3 128": lambda: tk_quant.per_token_cast(xb, "e4m3", 128),
        "per_channel_cast": lambda: tk_quant.per_channel_cast(xb128, "e4m3", 128),
        "cast_back e4m3": lambda: tk_quant.cast_back(q8, "bf16", (1, 128)),
        "gather check=True": lambda: tk_quant.per_channel_cast_fused(xb, "e4m3", 128, pos_to_token=pos),
        "gather check=False": lambda: tk_quant.per_channel_cast_fused(xb, "e4m3", 128, pos_to_token=pos, check=False),
    }
    for name, fn in ops.items():
        print(f"{name:28s} host {host_us(fn):7.1f} us/call   device {device_time_us(fn):6.1f} us", flush=True)

    # the lossless launch, piece by piece
    out = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=dev)
    sf = torch.empty((t, h // 128), dtype=torch.float32, device=dev)
    n_slots = num_ctas(t, h, 1, 128, config.get_num_sms(0))
    slots = torch.empty(n_slots, dtype=torch.int32, device=dev)
    sf_in_flat, s0, s1 = _sf_flat(xq[1])
    params = dict(hidden=h, bm_in=1, bk_in=32, in_kind="fp32", bm_out=1, bk_out=128, layout="row", passes=PASSES,
                  min_blocks=default_min_blocks(_tile(1, 128)[2], 1), zero_counts=True)
    k = per_block_cast_lossless_kernel.get(dev, **params)
    args = (xq[0].view(torch.int32), sf_in_flat, out.view(torch.uint32), sf.view(-1), slots, s0, s1)
    jk = per_block_cast_lossless_kernel.get(arch_of(dev), **params)  # the JITKernel
    exe = jk.adapter._get_executable()
    print(f"{'JITKernel.__call__':28s} host {host_us(lambda: jk(*args)):7.1f} us/call")
    print(f"{'adapter executable':28s} host {host_us(lambda: exe(*args)):7.1f} us/call")
    print(f"{'tk_core.jit.launcher':28s} host {host_us(lambda: k(*args)):7.1f} us/call")
    print(f"{'kernel cache get':28s} host {host_us(lambda: per_block_cast_lossless_kernel.get(dev, **params)):7.1f} us/call")
    print(f"{'torch.empty (64, 7168) e4m3':28s} host {host_us(lambda: torch.empty((t, h), dtype=torch.float8_e4m3fn, device=dev)):7.1f} us/call")
    print(f"{'xq[0].view(int32)':28s} host {host_us(lambda: xq[0].view(torch.int32)):7.1f} us/call")
    print(f"{'_sf_flat':28s} host {host_us(lambda: _sf_flat(xq[1])):7.1f} us/call")
    print(f"{'get_num_sms':28s} host {host_us(lambda: config.get_num_sms(0)):7.1f} us/call")
    print(f"{'current_stream(device)':28s} host {host_us(lambda: torch.cuda.current_stream(dev)):7.1f} us/call")
    print(f"{'current_stream()':28s} host {host_us(lambda: torch.cuda.current_stream()):7.1f} us/call")
    if hasattr(hostmem, "current_stream"):
        print(f"{'hostmem.current_stream(0)':28s} host {host_us(lambda: hostmem.current_stream(0)):7.1f} us/call")
    s = torch.cuda.current_stream()
    print(f"{'stream.synchronize (idle)':28s} host {host_us(s.synchronize):7.1f} us/call")

    if "--profile" not in sys.argv:
        return
    for name in ("lossless check=False", "per_token_cast e4m3 128", "lossless check=True"):
        prof = cProfile.Profile()
        fn = ops[name]
        prof.enable()
        for _ in range(1000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n=== cProfile: 1000 calls of {name} (own time) ===")
        pstats.Stats(prof).sort_stats("tottime").print_stats(28)


if __name__ == "__main__":
    main()
