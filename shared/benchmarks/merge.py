"""Folds the per-file pytest-benchmark JSONs of ``shared/gpu-check.sh`` into the saved per-package files.

    python3 shared/benchmarks/merge.py RUN_DIR shared/benchmarks/h200 "note on what was re-measured"

``RUN_DIR`` holds ``<package>-bench_<file>.json``; each of their rows replaces the saved row of the same test id
(``fullname``) in ``<dest>/<package>.json``, or is added. Rows that were not re-measured (e.g. the eager and
torch.compile references when the run filtered them out) are kept, and the note says which rows are new.
"""

import json
import pathlib
import sys


def main(run_dir: str, dest: str, note: str) -> None:
    runs = sorted(pathlib.Path(run_dir).glob("*-bench_*.json"))
    by_package: dict[str, list[dict]] = {}
    for path in runs:
        package = path.name.split("-bench_")[0]
        by_package.setdefault(package, []).append(json.loads(path.read_text()))
    for package, files in by_package.items():
        target = pathlib.Path(dest) / f"{package}.json"
        saved = json.loads(target.read_text()) if target.exists() else {**files[0], "benchmarks": []}
        rows = {b["fullname"]: b for b in saved["benchmarks"]}
        fresh = 0
        for run in files:
            for b in run["benchmarks"]:
                rows[b["fullname"]] = b
                fresh += 1
        saved["benchmarks"] = sorted(rows.values(), key=lambda b: b["fullname"])
        saved["machine_info"], saved["datetime"] = files[-1]["machine_info"], files[-1]["datetime"]
        saved["note"] = note
        target.write_text(json.dumps(saved, indent=1) + "\n")
        print(f"{target}: {fresh} rows re-measured, {len(rows)} in all")


if __name__ == "__main__":
    main(*sys.argv[1:4])
