"""The main job: encode a built-in sample of real text with stock Hugging Face and with ``pe.pack``, side by side.

    python -m packed_encoders.demo                 # ModernBERT-base config, random init, offline, CPU or GPU
    python -m packed_encoders.demo --model PATH    # a local checkpoint (and its tokenizer when present)

Prints per-token parity (cosine over real tokens, min and mean) and the speed of each path for queries and
documents, and exits with status 1 when parity fails. On CPU a few documents are used so it finishes in one to
two minutes on 2 cores (fp32; its speed figures come from one timed pass, each batch timed stock then packed back
to back, and it prints what they can and cannot show); on a GPU the whole sample runs, in bf16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import packed_encoders as pe
from packed_encoders.adapters.locate import find_encoders
from packed_encoders.data import load_sample
from packed_encoders.errors import PackedEncodersError, UnsupportedTargetError
from packed_encoders.pooling import mean_pool_reference

PAD_ID = 50283  # ModernBERT's [PAD]


def _build_model(path: str | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModel, ModernBertConfig, ModernBertModel

    if path:
        model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        source = path
    else:
        torch.manual_seed(0)
        config = ModernBertConfig()  # ModernBERT-base geometry: 22 layers, 768 hidden, 12 heads
        config._attn_implementation = "sdpa"
        model = ModernBertModel(config).to(dtype)
        source = "ModernBERT-base config, random init (seed 0)"
    return model.to(device).eval(), source


def _tokenizer(path: str | None):
    """The checkpoint's tokenizer, or ``None`` (no checkpoint, or none loadable there: the sample's own ids)."""
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # a checkpoint without a tokenizer still runs on the sample's ids
        print(f"(no tokenizer at {path}: {exc.__class__.__name__}; using the sample's OLMo token ids)")
        return None


def _texts_to_ids(sample: dict, tok, key: str) -> list[list[int]]:
    items = sample[key]
    if tok is not None:
        limit = sample["max_tokens"][key]
        return [tok(x["text"], truncation=True, max_length=limit)["input_ids"] for x in items]
    return [x["ids"] for x in items]


def _batches(seqs: list[list[int]], batch: int, pad_id: int, device):
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out = []
    for start in range(0, len(order), batch):
        rows = [seqs[i] for i in order[start:start + batch]]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
        out.append((ids.to(device), mask.to(device)))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _outputs(forward, batches):
    return [forward(input_ids=i, attention_mask=m).last_hidden_state for i, m in batches]


@torch.no_grad()
def _time(model, batches, device, repeats: int):
    """Seconds per pass over ``batches`` for stock HF (the class forward, which ``pe.pack`` leaves alone) and for
    the packed instance, medians over ``repeats`` passes, and the per-batch speed-ups. Each batch runs stock then
    packed back to back, so the two share whatever else the machine is doing. Both have run these batches before
    (the parity outputs): no warm-up here."""
    stock_forward = type(model).forward.__get__(model)
    t_stock, t_packed, ratios = [], [], []
    for _ in range(repeats):
        total_s = total_p = 0.0
        for i, m in batches:
            seconds = []
            for forward in (stock_forward, model):
                _sync(device)
                t0 = time.perf_counter()
                forward(input_ids=i, attention_mask=m)
                _sync(device)
                seconds.append(time.perf_counter() - t0)
            total_s, total_p = total_s + seconds[0], total_p + seconds[1]
            ratios.append(seconds[0] / seconds[1])
        t_stock.append(total_s)
        t_packed.append(total_p)
    return statistics.median(t_stock), statistics.median(t_packed), ratios


def _parity(stock_outs, packed_outs, batches):
    cos_tok, cos_pool = [], []
    for a, b, (_, m) in zip(packed_outs, stock_outs, batches):
        real = m.bool()
        cos_tok.append(torch.nn.functional.cosine_similarity(a[real].float(), b[real].float(), dim=-1))
        cos_pool.append(torch.nn.functional.cosine_similarity(mean_pool_reference(a, m), mean_pool_reference(b, m),
                                                              dim=-1))
    tok, pool = torch.cat(cos_tok), torch.cat(cos_pool)
    return float(tok.min()), float(tok.mean()), float(pool.min())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m packed_encoders.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local checkpoint path (default: ModernBERT-base config)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=8, help="sequences per call")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--documents", type=int, default=None, help="how many sample documents (default: all on "
                        "GPU, 4 of 200-700 tokens on CPU)")
    parser.add_argument("--queries", type=int, default=None, help="how many sample queries (default: all on GPU, "
                        "32 on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (default: 5 on GPU, 1 on CPU)")
    args = parser.parse_args(argv)
    for name in ("batch", "documents", "queries", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1 (got {value})")
    if args.model is not None and not os.path.isdir(args.model):
        print(f"--model {args.model}: no such directory (the demo loads a local checkpoint, a folder holding "
              "config.json and the weights; nothing is downloaded)", file=sys.stderr)
        return 2

    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
                              else args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch has no CUDA device (build {torch.__version__})")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    repeats = args.repeats or (5 if device.type == "cuda" else 1)
    sample = load_sample()
    tok = _tokenizer(args.model)
    queries = _texts_to_ids(sample, tok, "queries")
    documents = _texts_to_ids(sample, tok, "documents")
    on_gpu = device.type == "cuda"
    queries = queries[:args.queries or (len(queries) if on_gpu else 32)]
    n_docs = args.documents or (len(documents) if on_gpu else 4)
    if not on_gpu and args.documents is None:  # a CPU runs ModernBERT-base slowly: mid-length documents only
        documents = [d for d in documents if 200 <= len(d) <= 700] or documents
    if n_docs < len(documents):  # spread the subset over the length distribution
        step = len(documents) / n_docs
        documents = [documents[int(i * step + step / 2)] for i in range(n_docs)]

    try:
        model, source = _build_model(args.model, device, dtype)
    except (OSError, ValueError) as exc:  # a folder without weights, a config transformers cannot read
        print(f"--model {args.model}: cannot load it: {exc}", file=sys.stderr)
        return 2
    try:  # before the stock reference run: another architecture's forward fails there with its own, unrelated error
        find_encoders(model)
    except UnsupportedTargetError as exc:
        print(f"--model {args.model}: not a ModernBERT checkpoint the demo can pack: {exc}", file=sys.stderr)
        return 2
    vocab = model.config.vocab_size
    top = max(max(ids) for ids in (*queries, *documents) if ids)
    if top >= vocab:
        print(f"--model {args.model}: token id {top} is past its vocabulary ({vocab} entries)"
              + ("" if tok is not None else ": without a tokenizer there the demo feeds the sample's OLMo token ids "
                 "(ModernBERT's vocabulary); save the checkpoint's tokenizer beside it"),
              file=sys.stderr)
        return 2
    # padding is masked, so any id of the vocabulary serves; stock's embedding looks it up, so it must be one
    pad_id = next(i for i in (model.config.pad_token_id, PAD_ID, 0) if i is not None and 0 <= i < vocab)
    print(f"model: {source} | {str(dtype).replace('torch.', '')} on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    endpoints = {"queries": _batches(queries, args.batch, pad_id, device),
                 "documents": _batches(documents, args.batch, pad_id, device)}
    stock = {name: _outputs(model, batches) for name, batches in endpoints.items()}  # the parity reference

    t0 = time.perf_counter()
    try:
        pe.pack(model, attention_backend=args.attention_backend)
    except PackedEncodersError as exc:  # e.g. a backend that cannot run on this device: say so, not a traceback
        print(f"pe.pack refused: {exc}", file=sys.stderr)
        return 2
    pack_s = time.perf_counter() - t0
    info = pe.describe(model)["encoders"][0]
    print(f"pe.pack: {pack_s:.2f} s (validation included); kernels={info['kernels']}, "
          f"attention_backend={info['attention_backend']}")

    ok = True
    header = (f"{'endpoint':<10} {'texts':>5} {'tokens':>7} {'stock seq/s':>12} {'packed seq/s':>13} {'speed-up':>9}"
              f" {'cos min':>9} {'cos mean':>9} {'pooled min':>10}")
    if not on_gpu:
        print("(on a CPU the packed path has no GPU kernels or CUDA graphs: the speed-up here, below or above 1x, "
              "says nothing about a GPU's)")
    print(header)
    print("-" * len(header))
    spread = []
    for name, batches in endpoints.items():
        cmin, cmean, pmin = _parity(stock[name], _outputs(model, batches), batches)
        t_stock, t_packed, ratios = _time(model, batches, device, repeats)
        spread += ratios
        texts = sum(int(i.shape[0]) for i, _ in batches)
        tokens = sum(int(m.sum()) for _, m in batches)
        print(f"{name:<10} {texts:>5} {tokens:>7} {texts / t_stock:>12.2f} {texts / t_packed:>13.2f} "
              f"{t_stock / t_packed:>8.2f}x {cmin:>9.6f} {cmean:>9.6f} {pmin:>10.6f}")
        floor_min, floor_mean = (0.9999, 0.99999) if dtype == torch.float32 else (0.995, 0.999)
        if not (cmin >= floor_min and cmean >= floor_mean):
            ok = False
            print(f"  parity FAILED on {name}: per-token cosine min {cmin:.6f} (>= {floor_min}) "
                  f"mean {cmean:.6f} (>= {floor_mean})")
    if not on_gpu:
        print(f"CPU timing ({repeats} pass(es); each batch stock then packed, back to back): per-batch speed-ups "
              f"{min(spread):.2f}x-{max(spread):.2f}x.\nOn a CPU this is the padding not computed, less the packed "
              f"path's own overhead, in {str(dtype).replace('torch.', '')}; it moves with whatever else the CPU runs "
              "and says nothing about the GPU kernels, attention backends or CUDA graphs (time those on a GPU: "
              "benchmarks/).")
    print(f"attention used (last call): {pe.describe(model)['encoders'][0]['last_attention']}")
    print("parity: ok" if ok else "parity: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
