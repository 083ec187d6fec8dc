"""Run inside the PyLate environment (tests/envs/pylate.sh): ColBERT encode parity, stock vs packed.

Prints one JSON line with the measured numbers; exits non-zero on a mismatch.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

sys.path.insert(0, sys.argv[1])  # the repository root

import packed_encoders as pe  # noqa: E402
from tests.tiny_tokenizer import TEXTS, save_tiny_model  # noqa: E402


def main() -> int:
    from pylate import models

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(tmp)
        torch.manual_seed(0)
        colbert = models.ColBERT(model_name_or_path=path, embedding_size=32, device="cpu", query_length=16,
                                 document_length=64)
        colbert.eval()
        q_ref = colbert.encode(TEXTS[:4], is_query=True, batch_size=2, convert_to_tensor=False)
        d_ref = colbert.encode(TEXTS, is_query=False, batch_size=3, convert_to_tensor=False)
        pe.pack(colbert)
        info = pe.describe(colbert)["encoders"][0]
        q = colbert.encode(TEXTS[:4], is_query=True, batch_size=2, convert_to_tensor=False)
        d = colbert.encode(TEXTS, is_query=False, batch_size=3, convert_to_tensor=False)
        worst = 0.0
        for a, b in list(zip(q, q_ref)) + list(zip(d, d_ref)):
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            if a.shape != b.shape:
                print(json.dumps({"error": f"shape {tuple(a.shape)} != {tuple(b.shape)}"}))
                return 1
            worst = max(worst, float((a - b).abs().max()))
        pe.unpack(colbert)
        print(json.dumps({"max_abs_diff": worst, "path": info["path"], "packed": info["packed"],
                          "attention": info["last_attention"]}))
        return 0 if worst < 1e-4 and info["packed"] else 1


if __name__ == "__main__":
    sys.exit(main())
