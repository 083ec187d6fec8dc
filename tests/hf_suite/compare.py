"""Compare two junit XML reports of HF's ModernBERT tests: stock and packed (``run.sh`` writes them).

Prints every test that passed stock and did not pass packed, with its message, except those listed in
``KNOWN`` with their reason; exits 1 when an unlisted one exists."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

# test name -> why it cannot pass packed (the packed forward differs from stock there by design)
KNOWN: dict[str, str] = {}


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status, message = tag, (node.get("message") or "")[:300]
                break
        out[name] = (status, message)
    return out


def main(stock_xml: str, packed_xml: str) -> int:
    stock, packed = outcomes(stock_xml), outcomes(packed_xml)
    passed = [n for n, (s, _) in stock.items() if s == "passed"]
    regressions = [n for n in passed if packed.get(n, ("missing", ""))[0] != "passed"]
    both = sum(1 for n in passed if packed.get(n, ("",))[0] == "passed")
    print(f"stock: {len(passed)} passed of {len(stock)}; packed: {both} of those pass")
    unexplained = 0
    for n in regressions:
        short = n.rsplit("::", 1)[-1]
        reason = KNOWN.get(short)
        status, message = packed.get(n, ("missing", ""))
        print(f"{'known' if reason else 'NEW'} {n}: packed {status}: {reason or message}")
        unexplained += reason is None
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
