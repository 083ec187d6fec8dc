"""Compare two junit XML reports of HF's ModernBERT tests: stock and packed (``run.sh`` writes them).

Prints every test that passed stock and did not pass packed, with its message, except those listed in
``KNOWN`` with their reason; exits 1 when an unlisted one exists. Also lists the tests that passed packed without
the packed path running (every encoder call handed to the stock forward; ``pack_plugin`` counts them)."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

# test name -> why it cannot pass packed (the packed forward differs from stock there by design)
_ROPE = ("pack() refuses the config (UnsupportedTargetError): rope_type '{}' RoPE scaling is not implemented by the "
         "packed path, only 'default'")
KNOWN: dict[str, str] = {
    "test_model_rope_scaling_from_config_0_linear": _ROPE.format("linear"),
    "test_model_rope_scaling_from_config_1_dynamic": _ROPE.format("dynamic"),
    "test_model_rope_scaling_from_config_2_yarn": _ROPE.format("yarn"),
    # with PE_HF_SUITE_MASKS=contiguous only (HF's masks with holes run the stock forward for both calls)
    "test_can_capture_specific_layers_hidden_states": (
        "compares output_hidden_states=True (packed: padded positions are zeros) with a layer list (served by the stock "
        "forward: padded positions hold HF's values); real tokens are identical"),
}


def outcomes(path: str) -> dict[str, tuple[str, str, dict[str, int]]]:
    """test -> (status, message, counts): counts are pack_plugin's properties (packed_forwards, stock_forwards)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status, message = tag, (node.get("message") or "")[:300]
                break
        counts = {p.get("name"): int(p.get("value")) for p in case.iter("property")}
        out[name] = (status, message, counts)
    return out


def main(stock_xml: str, packed_xml: str) -> int:
    stock, packed = outcomes(stock_xml), outcomes(packed_xml)
    missing = ("missing", "", {})
    passed = [n for n, (s, _, _) in stock.items() if s == "passed"]
    regressions = [n for n in passed if packed.get(n, missing)[0] != "passed"]
    both = [n for n in passed if packed.get(n, missing)[0] == "passed"]
    ran = [n for n in both if packed[n][2].get("packed_forwards", 0) > 0]
    stock_only = [n for n in both if not packed[n][2].get("packed_forwards") and packed[n][2].get("stock_forwards")]
    print(f"stock: {len(passed)} passed of {len(stock)}; packed: {len(both)} of those pass, {len(ran)} of them "
          f"running the packed path, {len(stock_only)} only the stock forward (listed below)")
    unexplained = 0
    for n in regressions:
        short = n.rsplit("::", 1)[-1]
        reason = KNOWN.get(short)
        status, message, _ = packed.get(n, missing)
        print(f"{'known' if reason else 'NEW'} {n}: packed {status}: {reason or message}")
        unexplained += reason is None
    for n in stock_only:
        print(f"stock forward only: {n} ({packed[n][2]['stock_forwards']} calls)")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
