#!/usr/bin/env python3
"""The tables of a kernel A/B (`next-session.sh 7`): each shape's times in every round for a
changed tree and main, and the ratio of their medians (changed / main; below 1: the change is
faster), one table a changed tree and section. Reads DIR/NAME-ROUND-TREE.txt (bench_gpu_decode's
Markdown tables) for NAME in short (the serving shapes) and grid, TREE main and each changed tree
("changed" for a single .carry/patch.diff, else the names of .carry/patches/*.diff).

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


def changed_trees(directory):
    """The trees besides main that ran the first round of the grid."""
    trees = {p.name[len("grid-1-"):-len(".txt")] for p in directory.glob("grid-1-*.txt")}
    return sorted(trees - {"main"})


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: ab_table.py DIR (the results of next-session.sh 7)")
    directory = pathlib.Path(sys.argv[1])
    trees = changed_trees(directory)
    if not trees:
        sys.exit(f"ab_table.py: {directory}: no changed tree's grid-1-TREE.txt")
    for tree in trees:
        for name, title in SECTIONS:
            table(directory, tree, name, title if tree == "changed" else f"{tree}: {title}")


def table(directory, tree, name, title):
    changed, main_ = rounds(directory, name, tree), rounds(directory, name, "main")
    if not changed or len(changed) != len(main_):
        sys.exit(f"ab_table.py: {directory}: {len(changed)} rounds of {name} {tree}, "
                 f"{len(main_)} of main")
    print(f"## {title}, {len(changed)} rounds\n")
    print(f"| format | H | B | ctx | {tree} ms | main ms | {tree} / main |")
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
