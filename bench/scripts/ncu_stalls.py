"""Summarise an ``ncu --page source --print-source sass --csv`` export: each warp-stall reason's share
of all samples, with the instructions that took the most samples for it.

    python bench/scripts/ncu_stalls.py source16.csv.gz [--top 3]
"""
from __future__ import annotations

import argparse
import csv
import gzip

REASONS = ("selected", "short_sb", "wait", "long_sb", "not_selected", "math", "mio", "dispatch", "barrier",
           "branch_resolving", "no_inst", "lg", "imc", "drain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="the source page export (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=3, help="instructions listed per reason")
    args = parser.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as file:
        table = list(csv.reader(file))
    header = table[1]  # the first line names the kernel
    instructions = table[2:]
    source = header.index("Source")
    total = sum(float(row[header.index("Warp Stall Sampling (All Samples)")] or 0) for row in instructions)
    print(f"{len(instructions)} instructions, {total:.0f} samples")
    print("| reason | share of samples | instructions with the most |")
    print("| --- | ---: | --- |")
    for reason in REASONS:
        column = header.index(f"stall_{reason}")
        samples = [(float(row[column] or 0), row[source].strip()) for row in instructions]
        share = sum(count for count, _ in samples) / total
        top = sorted(samples, reverse=True)[:args.top]
        listed = "; ".join(f"`{text}` {count / total:.1%}" for count, text in top if count)
        print(f"| {reason} | {share:.1%} | {listed} |")


if __name__ == "__main__":
    main()
