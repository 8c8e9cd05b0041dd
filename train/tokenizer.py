"""The zoo's tokenizer: byte-level BPE trained on the corpus (tokenizers library).

    python -m train.tokenizer --data .cache/zoo [--vocab-size 8192]

reads `corpus.jsonl.gz` from the data folder, writes `tokenizer.json` beside it and records its
sha256 (and the corpus sha it was trained on) under "tokenizer" in `manifest.json`.

Ids 0 and 1 are the specials: "<|endoftext|>" (EOS, and the separator between documents) and
"<|mask|>" (the mask token DFlash and PARD drafters fill). Then the 256 byte symbols, then the
merges, up to `vocab_size` in all. Every byte sequence encodes (no unknown token) and decodes back
to itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from train.corpus import CORPUS_FILE, MANIFEST_FILE, iter_texts, sha256_of_docs, write_manifest

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN]
EOS_TOKEN_ID = 0
MASK_TOKEN_ID = 1
TOKENIZER_FILE = "tokenizer.json"


def train_bpe(texts, vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID and tok.token_to_id(MASK_TOKEN) == MASK_TOKEN_ID
    return tok


def build_tokenizer(data_dir: str | Path, vocab_size: int = 8192) -> dict:
    """Train on data_dir/corpus.jsonl.gz, write data_dir/tokenizer.json; returns the manifest entry."""
    data = Path(data_dir)
    manifest_path = data / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    corpus_sha = sha256_of_docs(data / CORPUS_FILE)
    if corpus_sha != manifest["corpus"]["sha256"]:
        raise SystemExit(f"{data / CORPUS_FILE}: sha256 {corpus_sha} differs from {manifest_path}; rebuild the corpus")
    tok = train_bpe(iter_texts(data / CORPUS_FILE), vocab_size)
    path = data / TOKENIZER_FILE
    tok.save(str(path))
    entry = {
        "file": TOKENIZER_FILE,
        "kind": "byte-level BPE (tokenizers)",
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {EOS_TOKEN: EOS_TOKEN_ID, MASK_TOKEN: MASK_TOKEN_ID},
        "trained_on_corpus_sha256": corpus_sha,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    manifest["tokenizer"] = entry
    write_manifest(data, manifest)
    return entry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=".cache/zoo", help="folder holding corpus.jsonl.gz (default .cache/zoo)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args(argv)
    entry = build_tokenizer(args.data, args.vocab_size)
    print(f"tokenizer: {entry['vocab_size']} tokens, sha256 {entry['sha256']}")


if __name__ == "__main__":
    main()
