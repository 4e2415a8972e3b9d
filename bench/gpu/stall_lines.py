#!/usr/bin/env python3
"""A kernel's per-instruction profile samples summed by source line.

Nsight Compute's source page (`bench/gpu/profile_sass.sh`: `ncu --page source --csv --print-source
sass`) lists a kernel's SASS instruction by instruction with its counters (stall samples,
executions), but without the source line each came from where the binary's line table is not read
back. `bash bench/gpu/census-fragments.sh CONTENT ROPE --as-built` prints that table for the same
kernel built here (`sass_census.py lines`: offset, opcode, file:line; the same sources, flags and
nvcc 13.0 as the device's build). This joins the two by the instruction's offset in the kernel
(the profile's first instruction is offset 0), checks that the opcodes the table names agree with
the profile's mnemonics (a build that differs shows as mismatches, and then nothing is summed),
and prints every numeric counter summed by source line, the lines with the most samples first.

  python3 bench/gpu/stall_lines.py SASS.csv LINES.txt [--top N] [--column TEXT]

--column picks the counter to rank by (the first column whose name contains TEXT; default the
stall samples of all issue states). --reasons prints, instead of every counter, the kernel's
samples by stall reason (the `stall_*` columns, issued and not) and each line's four largest.
--loop FILE:FIRST-LAST first splits the ranked counter into three regions of the kernel's code:
before, inside and after the span of instructions whose source lines are FIRST-LAST of FILE (a
page loop, say: what a launch spends on its set-up and epilogue against its loop).
"""
import argparse
import collections
import csv
import re
import sys

# Opcodes the line table names (sass_census.NAMES) that are also the start of their mnemonic.
CHECKED = {"HMMA", "HGMMA", "LDS", "STS", "STL", "LDL", "LOP3", "HADD2", "PRMT"}
PREDICATE = re.compile(r"^@!?U?P[0-9T]\s+")  # an instruction's guard, e.g. "@!P0 "


def read_lines(path):
    table = {}
    for row in open(path):
        if row.startswith("#") or not row.strip():
            continue
        offset, opcode, where = row.split()
        table[int(offset, 16)] = (opcode, where)
    return table


def number(text):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def read_profile(path):
    rows = list(csv.reader(open(path, newline="")))
    for k, row in enumerate(rows):
        if any("Address" in cell for cell in row):
            header = row
            body = rows[k + 1:]
            break
    else:
        sys.exit(f"{path}: no header row with an Address column")
    address = next(i for i, cell in enumerate(header) if "Address" in cell)
    source = next((i for i, cell in enumerate(header) if cell.strip() == "Source"), None)
    instructions = []
    for row in body:
        if len(row) != len(header):
            continue
        try:
            at = int(row[address], 16)
        except ValueError:
            continue
        instructions.append((at, row[source].strip() if source is not None else "", row))
    if not instructions:
        sys.exit(f"{path}: no instruction rows")
    return header, address, source, instructions


def largest_reasons(sums, reasons, header, count=4):
    """The `count` stall reasons with the most samples in `sums`, e.g. "wait 949, short_sb 521"."""
    largest = sorted(reasons, key=lambda i: -sums[i])[:count]
    return ", ".join(f"{header[i][6:]} {sums[i]:.0f}" for i in largest if sums[i])


def print_regions(loop, table, base, instructions, header, rank, reasons):
    match = re.fullmatch(r"(.+):(\d+)-(\d+)", loop)
    if not match:
        sys.exit(f"--loop {loop}: expected FILE:FIRST-LAST")
    name, first, last = match.group(1), int(match.group(2)), int(match.group(3))
    inside = []
    for offset, (_, where) in table.items():
        file, _, line = where.rpartition(":")
        if file.endswith(name) and line.isdigit() and first <= int(line) <= last:
            inside.append(offset)
    if not inside:
        sys.exit(f"--loop {loop}: no instruction has such a line")
    low, high = min(inside), max(inside)
    regions = {"before": [0.0] * len(header), "inside": [0.0] * len(header),
               "after": [0.0] * len(header)}
    for at, _, row in instructions:
        offset = at - base
        region = "before" if offset < low else "inside" if offset <= high else "after"
        for i in [rank] + reasons:
            regions[region][i] += number(row[i]) or 0.0
    total = sum(r[rank] for r in regions.values()) or 1.0
    print(f"{header[rank]} by region of {loop} (offsets {low:#x}-{high:#x}):")
    for region, sums in regions.items():
        print(f"  {region}: {100 * sums[rank] / total:.1f}%; "
              + largest_reasons(sums, reasons, header))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("lines")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--column", default="Warp Stall Sampling (All Samples)")
    parser.add_argument("--reasons", action="store_true")
    parser.add_argument("--loop", help="FILE:FIRST-LAST, e.g. decode_fragments.cuh:416-749")
    args = parser.parse_args()
    table = read_lines(args.lines)
    header, address, source, instructions = read_profile(args.profile)
    base = min(at for at, _, _ in instructions)
    checked = mismatched = unmapped = 0
    for at, text, _ in instructions:
        entry = table.get(at - base)
        if entry is None:
            unmapped += 1
            continue
        if entry[0] in CHECKED and text:
            checked += 1
            mismatched += not PREDICATE.sub("", text).startswith(entry[0])
    print(f"{len(instructions)} profiled instructions, {len(table)} in the line table, "
          f"{unmapped} without a line; opcodes checked {checked}, mismatched {mismatched}")
    if unmapped or mismatched > checked // 100:
        sys.exit("the profile and the line table are not the same binary: build the table from "
                 "the profiled sources and flags")
    columns = [i for i, name in enumerate(header)
               if i not in (address, source) and any(number(row[i]) is not None
                                                     for _, _, row in instructions)]
    rank = next((i for i in columns if args.column in header[i]), None)
    if rank is None:
        sys.exit(f"no counter column contains {args.column!r}; columns: "
                 + ", ".join(header[i] for i in columns))
    sums = collections.defaultdict(lambda: [0.0] * len(header))
    for at, _, row in instructions:
        where = table[at - base][1]
        for i in columns:
            sums[where][i] += number(row[i]) or 0.0
    total = sum(s[rank] for s in sums.values()) or 1.0
    # The per-reason columns of all samples ("stall_wait"; not the "(Not Issued)" copies).
    reasons = [i for i in columns
               if header[i].startswith("stall_") and "Not Issued" not in header[i]]
    if args.reasons:
        whole = {i: sum(s[i] for s in sums.values()) for i in reasons}
        samples = sum(whole.values()) or 1.0
        print("by stall reason: " + ", ".join(
            f"{header[i][6:]} {100 * v / samples:.1f}%"
            for i, v in sorted(whole.items(), key=lambda kv: -kv[1]) if v))
    if args.loop:
        print_regions(args.loop, table, base, instructions, header, rank, reasons)
    executed = next((i for i in columns if header[i] == "Instructions Executed"), None)
    listed = "each line's largest stall reasons" if args.reasons else "other counters where non-zero"
    print(f"by {header[rank]} (total {total:.0f}); {listed}")
    for where, s in sorted(sums.items(), key=lambda item: -item[1][rank])[:args.top]:
        if args.reasons:
            others = (f"executed {s[executed]:.0f}; " if executed is not None else "") + \
                largest_reasons(s, reasons, header)
        else:
            others = ", ".join(f"{header[i]} {s[i]:.0f}" for i in columns if i != rank and s[i])
        print(f"  {where}: {s[rank]:.0f} ({100 * s[rank] / total:.1f}%); {others}")


if __name__ == "__main__":
    main()
