#!/usr/bin/env python3
"""Where a kernel's register spills are, without a GPU or a disassembler.

This machine has nvcc and ptxas but neither cuobjdump nor nvdisasm, and `ptxas -v` says only how
many bytes a kernel spills. This reads a cubin built with line information (`nvcc -cubin
-lineinfo ...`, one kernel per cubin: both tables start at address 0) and prints each spill store
(STL) and reload (LDL) with the source line the line table gives its address, so that a spill in
the hot loop can be told from one before it. An sm_90 instruction is 16 bytes, its opcode the low
12 bits; STL is 0x387 and LDL 0x983 (the counts match ptxas's spill bytes: 4 bytes an instruction
for 32-bit spills). Needs binutils' readelf.

  python3 bench/gpu/spill_lines.py KERNEL.cubin
"""
import bisect
import re
import struct
import subprocess
import sys

SPILLS = {0x387: "STL", 0x983: "LDL"}


def text_sections(cubin):
    out = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True,
                         check=True).stdout
    sections = []
    for line in out.splitlines():
        m = re.search(r"\]\s+(\.text\.\S+)\s+PROGBITS\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m:
            sections.append((m.group(1), int(m.group(2), 16), int(m.group(3), 16)))
    return sections


def line_table(cubin):
    out = subprocess.run(["readelf", "--debug-dump=decodedline", cubin], capture_output=True,
                         text=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"(\S+\.(?:cuh|cu|h|hpp))\s+(\d+)\s+(0x[0-9a-f]+|\d+)", line)
        if m:
            rows.append((int(m.group(3), 0), m.group(1), int(m.group(2))))
    rows.sort()
    return rows


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    cubin = sys.argv[1]
    sections = text_sections(cubin)
    if len(sections) != 1:
        sys.exit(f"{cubin}: {len(sections)} kernels; build a cubin of one (their line tables "
                 "share addresses)")
    name, offset, size = sections[0]
    data = open(cubin, "rb").read()
    rows = line_table(cubin)
    addresses = [r[0] for r in rows]
    counts = {kind: 0 for kind in SPILLS.values()}
    print(f"{name[len('.text.'):]}: {size // 16} instructions")
    for at in range(0, size, 16):
        (low,) = struct.unpack_from("<Q", data, offset + at)
        kind = SPILLS.get(low & 0xFFF)
        if kind is None:
            continue
        counts[kind] += 1
        k = bisect.bisect_right(addresses, at) - 1
        where = f"{rows[k][1]}:{rows[k][2]}" if k >= 0 else "?"
        print(f"  {at:#07x} {kind} {where}")
    print("  " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))


if __name__ == "__main__":
    main()
