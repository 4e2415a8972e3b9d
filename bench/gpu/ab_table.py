#!/usr/bin/env python3
"""The table of a kernel A/B (`next-session.sh 7`): each shape's times in every round for the
changed tree and main, and the ratio of their medians (changed / main; below 1: the change is
faster). Reads DIR/NAME-ROUND-changed.txt and DIR/NAME-ROUND-main.txt (bench_gpu_decode's
Markdown tables) for NAME in short (the serving shapes) and grid.

    python3 bench/gpu/ab_table.py DIR > ab.txt
"""
import pathlib
import re
import statistics
import sys

SECTIONS = (("short", "serving shapes (--short-contexts)"), ("grid", "grid"))


def read_times(path):
    """{(format, H, B, ctx): ms} from one bench_gpu_decode table."""
    times = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not re.fullmatch(r"[0-9.]+", cells[4]):
            continue
        times[tuple(cells[:4])] = float(cells[4])
    return times


def rounds(directory, name, tree):
    paths = sorted(directory.glob(f"{name}-[0-9]*-{tree}.txt"))
    return [read_times(p) for p in paths]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: ab_table.py DIR (the results of next-session.sh 7)")
    directory = pathlib.Path(sys.argv[1])
    for name, title in SECTIONS:
        changed, main_ = rounds(directory, name, "changed"), rounds(directory, name, "main")
        if not changed or len(changed) != len(main_):
            sys.exit(f"ab_table.py: {directory}: {len(changed)} rounds of {name} changed, "
                     f"{len(main_)} of main")
        print(f"## {title}, {len(changed)} rounds\n")
        print("| format | H | B | ctx | changed ms | main ms | changed / main |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for shape in sorted(changed[0], key=lambda s: (s[0], int(s[1]), int(s[2]), int(s[3]))):
            a = [r[shape] for r in changed if shape in r]
            b = [r[shape] for r in main_ if shape in r]
            if len(a) != len(changed) or len(b) != len(main_):
                continue  # a shape a round lacks (a run cut off) is left out
            ratio = statistics.median(a) / statistics.median(b)
            print(f"| {' | '.join(shape)} | {' '.join(f'{x:.3f}' for x in a)} | "
                  f"{' '.join(f'{x:.3f}' for x in b)} | {ratio:.3f} |")
        print()


if __name__ == "__main__":
    main()
