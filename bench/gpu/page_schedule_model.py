#!/usr/bin/env python3
"""A timing model of the page schedule's slot ring (decode_warpgroup.cuh), to compare release orders.

Not a measurement: it replays the kernel's waits page by page with fixed phase durations, so that
the durations the phase-clocks probe measures (bench/gpu/probes/page-schedule-phase-clocks.diff,
`next-session.sh 11`) can be put in and the orders compared before any is written or timed:

  late-second     the kernel until the forty-first session: the previous page's first half
                  released once its P V is done (warpgroup 1 before waiting for its half,
                  warpgroup 0 after issuing its S, an issue that waits for the tensor pipe), its
                  second half once this page's S is done (the work-around for ptxas's C7514)
  main            both halves released as soon as the P V over each is done, before either
                  warpgroup waits for its half of the page (merged in the forty-first session)

--groups G: each half handed to S in G groups of boxes as they convert (1: main, whole halves;
9: the forty-third session's box-streamed-halves.diff, `git show
ed5abd7:bench/gpu/patches/stacked/box-streamed-halves.diff`), S starting on the first.

The model: the converting warpgroups convert the halves in order, each taking --convert cycles
once the slot's previous half is released by both multiplying warpgroups (--slots half-page
slots, three in the kernel, half h in slot h % slots); the tensor pipe runs one product at a time in the order issued: S (--scores cycles a
warpgroup's half page) and P V (--values cycles a warpgroup's half page, two a page each);
the softmax takes --softmax cycles from both S being done to P V's issue; a product's issue
returns once the pipe takes it. Prints the period of a page (cycles, after a warm-up) for each
order. With the forty-first session's durations (H200, 64 x 32K, INT4) it gives late-second 5,328
cycles against the 5,544 measured, and main 9.6% shorter, where main measured 5.7% shorter
there (INT4, two rounds).

  python3 bench/gpu/page_schedule_model.py [--convert 1800] [--scores 900] [--softmax 600]
      [--values 256] [--pages 40] [--slots 3] [--groups 9] [--phases PHASE.txt]

--phases takes the durations from the probe's lines (`next-session.sh 11`'s phase.txt; medians
over the stamped pages) where they are measured: a half page's conversion (converted, less the
later of its slot's release and its bytes' landing), warpgroup 1's S (its half converted to its
S done) and the softmax (the later S done to P V issued); it prints them and the measured period
beside the model's (P V's duration is not stamped: --values stays).
"""
import argparse
import re
import statistics


def period(order, convert, scores, softmax, values, pages, slots=3, groups=1):
    converted = []  # converted[h]: when half h is in its slot
    released = {}  # released[h]: when each multiplying warpgroup released half h's slot
    pipe_free = 0.0

    def product(issued, cycles):
        nonlocal pipe_free
        pipe_free = max(issued, pipe_free) + cycles
        return pipe_free

    def release(h, when):
        released.setdefault(h, []).append(when)

    # A half handed to S in `groups` groups of boxes (box-streamed-halves.diff: 9): S starts once
    # the first group is in and ends no sooner than its last group's products after the last one.
    streamed_ahead = convert * (groups - 1) / groups

    def scores_product(issued, h):
        nonlocal pipe_free
        pipe_free = max(product(issued, scores), converted[h] + scores / groups)
        return pipe_free

    def convert_through(h):
        # Converts halves in order up to h; False where a slot is not yet released by both.
        while len(converted) <= h:
            k = len(converted)
            start = converted[-1] if converted else 0.0
            if k >= slots:
                if len(released.get(k - slots, [])) < 2:
                    return False
                start = max(start, max(released[k - slots]))
            converted.append(start + convert)
        return True

    ready = [0.0, 0.0]  # when each multiplying warpgroup reaches the page
    first_half_done, second_half_done = {}, {}  # (warpgroup, page): its P V over each half done
    scores_done = []
    for i in range(pages):
        if i > 0:
            for w in (0, 1):
                done0, done1 = first_half_done[w, i - 1], second_half_done[w, i - 1]
                if order == "main":
                    release(2 * i - 2, max(ready[w], done0))
                    ready[w] = max(ready[w], done1)
                    release(2 * i - 1, ready[w])
                elif w == 1:
                    ready[1] = max(ready[1], done0)
                    release(2 * i - 2, ready[1])
        if not convert_through(2 * i):
            raise SystemExit(f"{order}: page {i}'s first half never converted (a wait in a circle)")
        issued0 = max(ready[0], converted[2 * i] - streamed_ahead)
        start_s0 = max(issued0, pipe_free)  # S's issue returns once the pipe takes it
        done_s0 = scores_product(issued0, 2 * i)
        if order == "late-second" and i > 0:
            release(2 * i - 2, max(start_s0, first_half_done[0, i - 1]))
        if not convert_through(2 * i + 1):
            raise SystemExit(f"{order}: page {i}'s second half never converted (a wait in a circle)")
        done_s1 = scores_product(max(ready[1], converted[2 * i + 1] - streamed_ahead), 2 * i + 1)
        if order == "late-second" and i > 0:
            release(2 * i - 1, done_s0)
            release(2 * i - 1, done_s1)
        issue = max(done_s0, done_s1) + softmax
        scores_done.append(max(done_s0, done_s1))
        ready = [issue, issue]
        for w in (0, 1):
            first_half_done[w, i] = product(issue, values)
        for w in (0, 1):
            second_half_done[w, i] = product(issue, values)
    warm = min(10, pages // 4)
    return (scores_done[-1] - scores_done[warm]) / (pages - 1 - warm)


def measured_durations(path):
    """Medians of the probe's durations, and the measured period, from its phase lines."""
    marks, halves = {}, {}
    for line in open(path):
        m = re.match(r"phase page (\d+) wg(\d):((?: -?\d+)+)\s*$", line)
        if m:
            marks[int(m.group(1)), int(m.group(2))] = [int(x) for x in m.group(3).split()]
            continue
        m = re.match(r"phase page (\d+) conv:(.*)$", line)
        if m:
            for e, start, released, landed, converted in re.findall(
                    r"half (\d) start (-?\d+) released (-?\d+) landed (-?\d+) converted (-?\d+)",
                    m.group(2)):
                halves[int(m.group(1)), int(e)] = (int(released), int(landed), int(converted))
    pages = sorted({page for page, _ in marks})
    if not pages or not halves:
        raise SystemExit(f"{path}: no phase lines of the converting page schedule")
    # A mark the probe never reached prints the stamp array's uninitialized value, billions of
    # cycles from the others (the forty-third session's run, whose rebased probe had lost mark 3).
    for (page, warpgroup), stamps in sorted(marks.items()):
        for k, stamp in enumerate(stamps):
            if abs(stamp) > 10**9:
                raise SystemExit(f"{path}: page {page} wg{warpgroup}'s mark {k} is {stamp}: never "
                                 f"stamped (does the probe still set it?)")
    convert = [c - max(r, l) for r, l, c in halves.values()]
    scores = [marks[page, 1][3] - marks[page, 1][2] for page in pages]
    softmax = [max(marks[page, 0][6], marks[page, 1][6]) -
               max(marks[page, 0][3], marks[page, 1][3]) for page in pages]
    periods = [marks[b, 0][0] - marks[a, 0][0] for a, b in zip(pages, pages[1:])]
    return {"convert": statistics.median(convert), "scores": statistics.median(scores),
            "softmax": statistics.median(softmax), "period": statistics.median(periods)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--convert", type=float, default=1800, help="cycles to convert a half page")
    parser.add_argument("--scores", type=float, default=900, help="cycles of one warpgroup's S")
    parser.add_argument("--softmax", type=float, default=600, help="cycles from S done to P V")
    parser.add_argument("--values", type=float, default=256,
                        help="cycles of one warpgroup's P V over a half page")
    parser.add_argument("--pages", type=int, default=40)
    parser.add_argument("--slots", type=int, default=3, help="half-page slots (the kernel's 3)")
    parser.add_argument("--groups", type=int, default=9,
                        help="groups of boxes a half is handed to S in, for the streamed row")
    parser.add_argument("--phases", help="the phase-clocks probe's output (durations from it)")
    args = parser.parse_args()
    if args.phases:
        measured = measured_durations(args.phases)
        args.convert, args.scores, args.softmax = (measured["convert"], measured["scores"],
                                                   measured["softmax"])
        print(f"measured: convert {args.convert:.0f}, scores {args.scores:.0f}, softmax "
              f"{args.softmax:.0f} cycles; period {measured['period']:.0f} cycles a page")
    for order, groups in (("late-second", 1), ("main", 1), ("main", args.groups)):
        cycles = period(order, args.convert, args.scores, args.softmax, args.values, args.pages,
                        args.slots, groups)
        label = order if groups == 1 else f"{order}, {groups} groups"
        print(f"{label:17s} {cycles:7.0f} cycles a page")


if __name__ == "__main__":
    main()
