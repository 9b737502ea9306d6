"""The data flags of a GPT pretraining run (this project's addition to Megatron-LM HEAD's config package).

Megatron-LM HEAD has no ``dataset`` slice in its container yet. Here the container holds the *flags*
(``DataConfig``), not a ``GPTDatasetConfig``: that one needs the tokenizer and the padded vocabulary,
which exist only once the tokenizer is built at run time, and ``GPTDatasetConfig.__post_init__``
checks the blend and split against each other. ``DataConfig.to_gpt_dataset_config`` builds it then,
from this record alone.
"""
from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class DataConfig:
    """Data sources, split, sample shape and data-loader settings (the "data and dataloader" flag group)."""

    data_path: Optional[list] = None
    split: Optional[str] = None
    """``validate_args`` fills in Megatron's legacy ``"969, 30, 1"`` when ``--data-path`` has none."""
    train_data_path: Optional[list] = None
    valid_data_path: Optional[list] = None
    test_data_path: Optional[list] = None
    data_cache_path: Optional[str] = None
    mock_data: bool = False
    seq_length: Optional[int] = None
    num_workers: int = 2
    dataloader_type: Optional[str] = None
    """Derived: ``single`` when not given."""
    data_sharding: bool = True
    """Megatron's data-loader setting without a flag here (no ``--no-data-sharding``): each data-parallel
    rank reads its own shard of the cyclic sampler's buckets."""
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask_in_dataloader: bool = True
    mmap_bin_files: bool = True
    mid_level_dataset_surplus: float = 0.005
    num_dataset_builder_threads: int = 1

    def validate(self) -> None:
        """One data source at most, a ``--split`` that parses, builder threads > 0 (ValueError naming the flag).

        The split is parsed here, once, so that a malformed --split stops the run with one line (rank 0)
        before any rank builds a dataset; the datasets parse the same string again.
        """
        from megatron.core.datasets.utils import parse_and_normalize_split

        sources = [name for name, used in (
            ("--data-path", bool(self.data_path)),
            ("--mock-data", bool(self.mock_data)),
            ("--train-data-path/--valid-data-path/--test-data-path",
             any([self.train_data_path, self.valid_data_path, self.test_data_path])),
        ) if used]
        if len(sources) > 1:
            raise ValueError(f"a single data source must be given, got {' and '.join(sources)}")
        if self.split is not None:
            parse_and_normalize_split(self.split)  # ValueError naming --split and the value
        if not self.num_dataset_builder_threads > 0:
            raise ValueError(f"--num-dataset-builder-threads must be > 0, got {self.num_dataset_builder_threads}")

    def to_gpt_dataset_config(self, tokenizer, seed: int, vocab_size: Optional[int]):
        """The core ``GPTDatasetConfig`` of these flags (``pretrain_gpt.py``'s ``core_gpt_dataset_config_from_args``).

        Args:
            tokenizer: the run's tokenizer (its ``eod`` id marks document ends).
            seed: the run's ``--seed`` (``RNGConfig.seed``), which shuffles the sample index.
            vocab_size: the padded vocabulary; token ids at or beyond it are reported naming the .bin file.
        """
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
        from megatron.core.datasets.utils import get_blend_from_list

        return GPTDatasetConfig(
            random_seed=seed,
            sequence_length=self.seq_length,
            blend=get_blend_from_list(self.data_path),
            blend_per_split=[
                get_blend_from_list(self.train_data_path),
                get_blend_from_list(self.valid_data_path),
                get_blend_from_list(self.test_data_path),
            ],
            split=self.split,
            num_dataset_builder_threads=self.num_dataset_builder_threads,
            path_to_cache=self.data_cache_path,
            mmap_bin_files=self.mmap_bin_files,
            tokenizer=tokenizer,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
            eod_mask_loss=self.eod_mask_loss,
            create_attention_mask=self.create_attention_mask_in_dataloader and self.reset_attention_mask,
            mid_level_dataset_surplus=self.mid_level_dataset_surplus,
            mock=self.mock_data,
            vocab_size=vocab_size,
        )
