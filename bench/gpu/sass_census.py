#!/usr/bin/env python3
"""A kernel's SASS counted from its cubin, without a GPU or a disassembler.

This machine has nvcc and ptxas but neither cuobjdump nor nvdisasm. A cubin built with line
information (`nvcc -cubin -lineinfo ...`, one kernel per cubin: the line tables of several would
share addresses) still says, instruction by instruction, which source line each comes from, and an
sm_90 instruction is 16 bytes with its opcode in the low 12 bits. So, without decoding operands:

  spills CUBIN
      each register spill store (STL) and reload (LDL) with its source line, so that a spill in a
      hot loop can be told from one in a prologue where `ptxas -v` gives only the bytes.
  loop CUBIN SOURCE FIRST LAST [--exclude A-B ...] [--strict] [--by-line]
      the instructions between the first and the last one that SOURCE's lines FIRST..LAST produce
      (a fully unrolled loop body: per warp and iteration, static), by opcode; --exclude leaves out
      the lines of a runtime inner loop (e.g. one that runs zero times on the measured shape);
      --strict applies --exclude to SOURCE's lines outside FIRST..LAST too (code placed within
      the loop's addresses, e.g. the kernel's end); --by-line adds each source line's count.
  lines CUBIN
      every instruction's offset in the kernel, opcode and source line: the key to join with a
      profile's per-instruction samples (Nsight Compute's source page lists SASS by offset) where
      the cubin was built here from the same sources and flags as the profiled binary (the same
      nvcc 13.0 on both machines).

Opcodes are named where the source lines they come from say what they are (HMMA from mma.sync,
HGMMA from wgmma, LOP3 from a lop3 asm, HADD2 from __hsub2 / __hadd2 / __hmul2's family, PRMT from
__byte_perm, WARPGROUP from wgmma.fence / wait_group), STL / LDL where their counts match ptxas's
spill bytes; the rest print as numbers. Needs binutils' readelf.
"""
import argparse
import bisect
import collections
import re
import struct
import subprocess
import sys

NAMES = {
    0x23C: "HMMA",
    0xDF0: "HGMMA",
    0x984: "LDS",
    0x988: "STS",
    0x387: "STL",
    0x983: "LDL",
    0x812: "LOP3",
    0x430: "HADD2",
    0x816: "PRMT",
    0x9C5: "WARPGROUP",
}


def code_sections(cubin):
    """Every kernel's machine code in CUBIN: {kernel name: the bytes of its .text section}."""
    out = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True,
                         check=True).stdout
    data = open(cubin, "rb").read()
    return {m.group(1): data[int(m.group(2), 16):int(m.group(2), 16) + int(m.group(3), 16)]
            for m in re.finditer(
                r"\]\s+\.text\.(\S+)\s+PROGBITS\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)", out)}


def opcodes(code):
    """Each 16-byte sm_90 instruction's opcode: its low 12 bits."""
    return [struct.unpack_from("<Q", code, at)[0] & 0xFFF for at in range(0, len(code), 16)]


class Cubin:
    def __init__(self, path):
        sections = code_sections(path)
        if len(sections) != 1:
            sys.exit(f"{path}: {len(sections)} kernels; build a cubin of one (their line tables "
                     "share addresses)")
        (self.name, code), = sections.items()
        self.opcodes = opcodes(code)
        out = subprocess.run(["readelf", "--debug-dump=decodedline", path], capture_output=True,
                             text=True).stdout
        rows = sorted((int(m.group(3), 0), m.group(1), int(m.group(2))) for m in re.finditer(
            r"^(\S+\.(?:cuh|cu|h|hpp))\s+(\d+)\s+(0x[0-9a-f]+|\d+)", out, re.M))
        self.addresses = [r[0] for r in rows]
        self.rows = rows

    def line(self, index):
        k = bisect.bisect_right(self.addresses, 16 * index) - 1
        return (self.rows[k][1], self.rows[k][2]) if k >= 0 else ("?", 0)


def name(opcode):
    return NAMES.get(opcode, f"{opcode:#05x}")


def spills(args):
    cubin = Cubin(args.cubin)
    counts = collections.Counter()
    print(f"{cubin.name}: {len(cubin.opcodes)} instructions")
    for i, opcode in enumerate(cubin.opcodes):
        if opcode in (0x387, 0x983):
            counts[name(opcode)] += 1
            file, line = cubin.line(i)
            print(f"  {16 * i:#07x} {name(opcode)} {file}:{line}")
    print(f"  {counts['STL']} STL, {counts['LDL']} LDL")


def loop(args):
    cubin = Cubin(args.cubin)
    source = args.source.rsplit("/", 1)[-1]
    excluded = [tuple(map(int, e.split("-"))) for e in args.exclude]
    lines = [cubin.line(i) for i in range(len(cubin.opcodes))]
    inside = [i for i, (file, line) in enumerate(lines)
              if file == source and args.first <= line <= args.last]
    if not inside:
        sys.exit(f"no instruction comes from {source}:{args.first}-{args.last}")
    # An instruction of the excluded lines is left out, and so is one inlined there from a helper
    # (another file's lines, or SOURCE's outside FIRST..LAST): one whose nearest instructions of
    # the loop's own lines before and after are both excluded.
    own_excluded = [any(a <= lines[i][1] <= b for a, b in excluded) for i in inside]

    # --strict: --exclude applies to SOURCE's lines outside FIRST..LAST too (code that the compiler
    # placed inside the loop's address range, e.g. what follows the loop), and a helper's
    # instruction is left out where SOURCE's nearest instructions of any line are both left out.
    if args.strict:
        inside = [i for i, (file, _) in enumerate(lines) if file == source and
                  inside[0] <= i <= inside[-1]]
        own_excluded = [any(a <= lines[i][1] <= b for a, b in excluded) for i in inside]

    def left_out_at(i):
        k = bisect.bisect_left(inside, i)
        if k < len(inside) and inside[k] == i:
            return own_excluded[k]
        return 0 < k < len(inside) and own_excluded[k - 1] and own_excluded[k]

    counts, left_out = collections.Counter(), 0
    by_line = collections.defaultdict(collections.Counter)
    for i in range(inside[0], inside[-1] + 1):
        file, line = lines[i]
        if left_out_at(i):
            left_out += 1
        else:
            counts[cubin.opcodes[i]] += 1
            by_line[(file, line)][cubin.opcodes[i]] += 1
    print(f"{cubin.name}: {source}:{args.first}-{args.last} at {16 * inside[0]:#x}-"
          f"{16 * inside[-1]:#x}: {sum(counts.values())} instructions ({left_out} left out)")
    print("  " + ", ".join(f"{name(op)} {n}" for op, n in counts.most_common()))
    if args.by_line:
        for (file, line), ops in sorted(by_line.items()):
            print(f"  {file}:{line}: {sum(ops.values())} (" +
                  ", ".join(f"{name(op)} {n}" for op, n in ops.most_common()) + ")")


def line_table(args):
    cubin = Cubin(args.cubin)
    print(f"# {cubin.name}: offset opcode file:line")
    for i, opcode in enumerate(cubin.opcodes):
        file, line = cubin.line(i)
        print(f"{16 * i:#06x} {name(opcode)} {file}:{line}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("spills")
    p.add_argument("cubin")
    p.set_defaults(run=spills)
    p = sub.add_parser("loop")
    p.add_argument("cubin")
    p.add_argument("source")
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--exclude", action="append", default=[], metavar="A-B")
    p.add_argument("--strict", action="store_true")
    p.add_argument("--by-line", action="store_true",
                   help="also each source line's instructions, by opcode")
    p.set_defaults(run=loop)
    p = sub.add_parser("lines")
    p.add_argument("cubin")
    p.set_defaults(run=line_table)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
