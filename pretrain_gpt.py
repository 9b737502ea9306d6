"""Pretrain a GPT model: Megatron's model provider, forward step and dataset provider, handed to pretrain().

Launch with torchrun, e.g.::

    torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 4 --hidden-size 128 ... --data-path PREFIX
"""
import copy
import os
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import unwrap_model
from megatron.training import argument_utils
from megatron.training.global_vars import get_config, get_timers, get_tokenizer
from megatron.training.training import pretrain
from megatron.training.user_errors import UserInputError, run_reporting_user_errors
from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank, print_rank_0


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None) -> GPTModel:
    """The GPT model for this pipeline stage (chunk ``vp_stage`` with interleaving), from the run's
    configuration (``get_config()``: ``model``, ``gpt`` and the tokenizer's padded vocabulary)."""
    cfg = get_config()
    gpt = cfg.gpt
    print_rank_0("building GPT model ...")
    # Each chunk gets its own TransformerConfig, as when Megatron-LM builds one from args per call: the
    # training loop sets run-time callbacks (timers, grad sync) on the first chunk's config only.
    config = copy.copy(cfg.model)
    return GPTModel(
        config=config,
        vocab_size=cfg.tokenizer.padded_vocab_size,
        max_sequence_length=gpt.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=gpt.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not gpt.untie_embeddings_and_output_weights,
        position_embedding_type=gpt.position_embedding_type,
        rotary_percent=gpt.rotary_percent,
        rotary_base=gpt.rotary_base,
        rope_scaling=gpt.use_rope_scaling,
        rope_scaling_factor=gpt.rope_scaling_factor,
        seq_len_interpolation_factor=gpt.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator, vp_stage=None):
    """Micro batch tensors on this rank's device: tokens, labels, loss_mask, attention_mask, position_ids.

    The model applies causal masking itself, so a mask is only passed when ``--reset-attention-mask``
    makes it differ from the causal one. Only the first pipeline stage (its first chunk) and the last
    (its last chunk) read data; other stages and chunks get five Nones and take their input from the
    previous stage.
    """
    if not (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator, needs_attention_mask=get_config().data.reset_attention_mask)
    batch = get_batch_on_this_cp_rank(batch)  # context parallelism: this rank's two chunks of each sequence
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked sum of per-token losses ``[b, s]``, the token count, and the report for logging.

    Returns ``(loss, num_tokens, {'lm loss': [loss_sum, num_tokens]})``; the schedule divides by
    the token count and the number of microbatches (spec §5).
    """
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro batch through the model: returns the per-token loss and the loss function to apply."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = getattr(unwrap_model(model), "vp_stage", None)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank() -> bool:
    """Datasets live on TP rank 0 of the first and last pipeline stages; others receive broadcasts."""
    return (
        parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    ) and parallel_state.get_tensor_model_parallel_rank() == 0


def check_data_prefixes(data) -> None:
    """Every prefix of ``--data-path`` / ``--train|valid|test-data-path`` has its ``.bin`` and ``.idx``.

    ``data``: the run's DataConfig (``get_config().data``).

    Raises:
        UserInputError: naming the flag and the prefix; when ``PREFIX_text_document.bin`` exists (the
            name tools/preprocess_data.py gives its output) the message suggests that prefix.
    """
    if data.mock_data:
        return
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        blend = get_blend_from_list(getattr(data, flag))
        for prefix in blend[0] if blend else []:
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if not missing:
                continue
            name = "--" + flag.replace("_", "-")
            message = f"{name}: no dataset at prefix {prefix!r} (missing {', '.join(missing)})"
            if os.path.isfile(prefix + "_text_document.bin") and os.path.isfile(prefix + "_text_document.idx"):
                message += f"; did you mean {name} {prefix}_text_document?"
            raise UserInputError(message)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """GPTDatasetConfig from the data flags, the seed, the padded vocabulary and the global tokenizer."""
    return argument_utils.core_gpt_dataset_config_from_args(args, get_tokenizer())


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Build the train, validation and test datasets (None where a split is empty)."""
    cfg = get_config()
    check_data_prefixes(cfg.data)
    # ids beyond the padded vocabulary are reported naming the .bin file
    config = cfg.data.to_gpt_dataset_config(get_tokenizer(), seed=cfg.rng.seed,
                                            vocab_size=cfg.tokenizer.padded_vocab_size)
    dataset_type = MockGPTDataset if cfg.data.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    try:
        train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
            dataset_type, train_val_test_num_samples, is_dataset_built_on_rank, config
        ).build()
    except ValueError as error:  # the builder's ValueErrors name the dataset and the flag (an empty split, ...)
        raise UserInputError(str(error)) from error
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


def require_inputs(parser):
    """Extra-args provider: this script reads a tokenizer and a dataset, so their flags are required."""
    parser.set_defaults(require_inputs=True)
    return parser


def main() -> None:
    """Pretrain with the command-line flags; a user-input error ends the run with one line, no traceback.

    ``--tokenizer-type`` defaults to GPT2BPETokenizer, as in Megatron-LM's pretrain_gpt.py.
    """
    run_reporting_user_errors(pretrain, train_valid_test_datasets_provider, model_provider, forward_step,
                              extra_args_provider=require_inputs, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


if __name__ == "__main__":
    main()
