"""Lists every line of the anchor figures next to our saved benchmark row of the same op and options.

    python3 shared/benchmarks/anchor_report.py ../shared/spec/anchor-figures.md shared/benchmarks/h200/*.json

An anchor line is a table row ``| kernel | k=v, k=v, ... | time (us) | GB/s |``. Its rows of ours are, per
implementation of ours (``tk`` and variants such as ``tk-unchecked``), the row of a pytest-benchmark file whose
``extra_info`` has the same ``kernel`` and the same value for every option both name, ``num_tokens`` excepted (the
MoE lines' routed token counts come from random routing); of several, the one that names the most of the line's
options. Prints kernel, implementation, the anchor's GB/s, ours, their ratio and the options, or ``-`` where no row
matches (ops of other packages).
"""

import json
import sys

IGNORED = {"num_tokens"}  # differs run to run on the MoE lines (random routing)


def split_options(text: str) -> dict[str, str]:
    """``"a=1, b=[1, 32], c=x"`` -> ``{"a": "1", "b": "[1, 32]", "c": "x"}`` (commas inside brackets kept)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return dict(p.strip().split("=", 1) for p in parts if "=" in p)


def anchor_lines(path: str):
    """(kernel, {option: value as text}, GB/s) per table row of the anchor file."""
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 4 or not cells[3].replace(",", "").isdigit():
                continue
            yield cells[0], split_options(cells[1]), float(cells[3].replace(",", ""))


def our_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [b["extra_info"] for b in json.load(f)["benchmarks"] if b["extra_info"].get("impl", "").startswith("tk")]
    return rows


def match(kernel: str, impl: str, options: dict, rows: list[dict]) -> dict | None:
    best, named = None, -1
    for row in rows:
        if row.get("kernel") != kernel or row["impl"] != impl:
            continue
        shared = [k for k in options if k in row and k not in IGNORED]
        if all(str(row[k]) == options[k] for k in shared) and len(shared) > named:
            best, named = row, len(shared)
    return best


def main(anchor_path: str, *json_paths: str) -> None:
    rows = our_rows(list(json_paths))
    impls = sorted({r["impl"] for r in rows})
    for kernel, options, anchor in anchor_lines(anchor_path):
        text = ", ".join(f"{k}={v}" for k, v in options.items())
        found = [(impl, row) for impl in impls if (row := match(kernel, impl, options, rows))]
        for impl, row in found or [("-", None)]:
            ours = f"{row['gbps']:7,.0f} {row['gbps'] / anchor:6.3f}" if row else f"{'-':>7} {'-':>6}"
            print(f"{kernel:50s} {impl:12s} {anchor:7,.0f} {ours}  {text}")


if __name__ == "__main__":
    main(*sys.argv[1:])
