#!/usr/bin/env python3
"""Whether two builds of the same kernels carry the same machine code, kernel by kernel.

  python3 bench/gpu/compare_cubins.py [--map PATTERN REPLACEMENT]... DIR_A DIR_B

DIR_A and DIR_B hold cubins of the same names (`bench/gpu/same-machine-code.sh` builds them from
two trees). Each kernel's code section (`.text.NAME`, sass_census.code_sections; anonymous
namespaces' per-build hashes taken out of the names) is compared byte for byte: a change whose
kernels all stay identical needs no timing. For a kernel that differs: its instruction counts
(16 bytes an sm_90 instruction), whether the opcode sequence (each instruction's low 12 bits) is
the same, and the opcodes whose counts moved. Exits 1 if any kernel differs or is missing.
--map renames DIR_B's kernels (re.sub) before they are paired with DIR_A's: a kernel that gained a
template parameter (e.g. `--map ELb0EEEv EEEv` for a bool appended as false) is compared with
its old self, and a kernel the change added is reported as only in DIR_B.
"""
import collections
import os
import re
import sys

from sass_census import code_sections, opcodes


def without_anonymous_namespaces(name):
    """NAME with each anonymous namespace's mangled identifier (its length, then _GLOBAL__N__
    and a per-build suffix: nvcc 13 writes the file's name, a hash of its contents and a number
    that changes between builds) as `_GLOBAL__N_`."""
    while True:
        match = re.search(r"(\d+)(_GLOBAL__N__)", name)
        if not match:
            return name
        end = match.start(2) + int(match.group(1))
        name = name[: match.start()] + "11_GLOBAL__N_" + name[end:]


def kernels(path, renames=()):
    """code_sections with anonymous namespaces' per-build hashes taken out of the names, then
    each (pattern, replacement) of `renames` applied."""
    result = {}
    for name, code in code_sections(path).items():
        name = without_anonymous_namespaces(name)
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        result[name] = code
    return result


def main():
    args = sys.argv[1:]
    renames = []
    while len(args) >= 3 and args[0] == "--map":
        renames.append((args[1], args[2]))
        args = args[3:]
    if len(args) != 2:
        sys.exit(__doc__)
    a_dir, b_dir = args
    same = differ = 0
    for cubin in sorted(f for f in os.listdir(a_dir) if f.endswith(".cubin")):
        b_path = os.path.join(b_dir, cubin)
        if not os.path.exists(b_path):
            print(f"{cubin}: missing in {b_dir}")
            differ += 1
            continue
        a, b = kernels(os.path.join(a_dir, cubin)), kernels(b_path, renames)
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                print(f"{cubin}: {name} only in {a_dir if name in a else b_dir}")
                differ += 1
            elif a[name] == b[name]:
                same += 1
            else:
                differ += 1
                oa, ob = opcodes(a[name]), opcodes(b[name])
                ca, cb = collections.Counter(oa), collections.Counter(ob)
                moved = {f"{op:#05x}": cb[op] - ca[op] for op in sorted(set(ca) | set(cb))
                         if ca[op] != cb[op]}
                print(f"{cubin}: {name}: {len(oa)} -> {len(ob)} instructions, opcode sequence "
                      f"{'the same' if oa == ob else 'changed'}, counts moved {moved}")
    print(f"{same} kernels' machine code identical, {differ} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
