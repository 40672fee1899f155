#!/usr/bin/env python3
"""Two launch traces side by side, from trace.py's tables (tvariant-*.md, tr-*.md).

For each kernel (module and grid) of either: launches a step, us a step in A and in B, and B - A;
then the median step, the host's gap after it and the GPU chain (their difference) of each. Rows
sorted by |B - A|, largest first; a kernel only one trace has shows its launches as 0 in the
other. Several files per side (rounds of one variant, `a1.md,a2.md`) are averaged.

    trace-diff.py A.md[,A2.md..] B.md[,B2.md..] [--top K]
"""
import re
import statistics
import sys


def parse(path):
    """(kernels: {name: (launches, us a step)}, step, after) of one trace.py output."""
    kernels, step, after = {}, None, None
    with open(path) as f:
        for line in f:
            if step is None:
                m = re.search(r"median step ([0-9.]+) us", line)
                a = re.search(r"after the last launch ([0-9.]+) us", line)
                if m and a:
                    step, after = float(m.group(1)), float(a.group(1))
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 5 and cells[1].isdigit():
                kernels[cells[0]] = (int(cells[1]), float(cells[2]))
    if step is None:
        sys.exit(f"{path}: no trace.py header line")
    return kernels, step, after


def side(paths):
    """The traces of one side averaged: kernels {name: (launches, us)}, step, after."""
    runs = [parse(p) for p in paths.split(",")]
    names = set().union(*(r[0] for r in runs))
    kernels = {}
    for k in names:
        have = [r[0][k] for r in runs if k in r[0]]
        kernels[k] = (have[0][0], statistics.mean(us for _, us in have) * len(have) / len(runs))
    return kernels, statistics.mean(r[1] for r in runs), statistics.mean(r[2] for r in runs)


def main():
    args = sys.argv[1:]
    top = int(args[args.index("--top") + 1]) if "--top" in args else 25
    files = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--top")]
    if len(files) != 2:
        sys.exit(__doc__)
    (ka, sa, aa), (kb, sb, ab) = side(files[0]), side(files[1])
    print(f"A {files[0]}: step {sa:.1f} us, after it {aa:.1f}, chain {sa - aa:.1f}")
    print(f"B {files[1]}: step {sb:.1f} us, after it {ab:.1f}, chain {sb - ab:.1f}")
    print(f"B - A: step {sb - sa:+.1f} us, chain {(sb - ab) - (sa - aa):+.1f} us")
    print("\n| kernel (module grid) | launches A / B | us a step A | us a step B | B - A |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for k in set(ka) | set(kb):
        (na, ua), (nb, ub) = ka.get(k, (0, 0.0)), kb.get(k, (0, 0.0))
        rows.append((k, na, nb, ua, ub))
    for k, na, nb, ua, ub in sorted(rows, key=lambda r: -abs(r[4] - r[3]))[:top]:
        print(f"| {k} | {na} / {nb} | {ua:.1f} | {ub:.1f} | {ub - ua:+.1f} |")


if __name__ == "__main__":
    main()
