"""Old import paths keep working: every public name Megatron-LM users and this project's docs import, from the
path it has at the pre-move commit b6fed8d (the guard of issue 29 / design note 4.3, item 4).

The lists below were generated once from that commit's code and written out literally on purpose: after
the checkpoint package and the config move, each name must still import from here (a re-export shim is
fine) and still be what it was (a class stays a class, a function a callable, a constant keeps its value).
Do not regenerate them from the code: a name that disappears would then disappear from the test too.

- ``CHECKPOINTING`` / ``ARGUMENTS``: the Megatron-signature names of design note 4.3 item 4;
- ``SHIM_MODULES``: the four modules that become re-export shims, with the public names (no leading
  underscore) each defines today. Left out: ``checkpoint_integrity.test_hook``, the MEGATRON_TEST_* fault
  hook that the design note (4.1) moves out of production code into tests/faulty_pretrain.py;
- ``MODEL_AND_OPTIMIZER``: every public name defined in megatron.core.dist_checkpointing.model_and_optimizer;
- ``ARCHITECTURE``: the packages, modules and key public names of docs/ARCHITECTURE.md's table (its
  ``get_*_group/rank/world_size`` of parallel_state expanded to the functions that match today), and the
  tools' scripts the table names (files, since tools/ is not a package).
"""
import importlib
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLASS, CALLABLE = "class", "callable"  # a constant is recorded with its value instead

CHECKPOINTING = {"megatron.training.checkpointing": {
    "save_checkpoint": CALLABLE, "load_checkpoint": CALLABLE, "get_checkpoint_name": CALLABLE,
    "get_checkpoint_tracker_filename": CALLABLE, "read_metadata": CALLABLE, "finalize_async_save": CALLABLE,
    "load_state_dict_file": CALLABLE}}
ARGUMENTS = {"megatron.training.arguments": {
    "parse_args": CALLABLE, "validate_args": CALLABLE, "core_transformer_config_from_args": CALLABLE}}
SHIM_MODULES = {
    "megatron.training.checkpoint_integrity": {
        "CheckpointIntegrityError": CLASS, "FailedOnAnotherRankError": CLASS, "NotARegularFileError": CLASS,
        "CheckpointTrackerError": CLASS, "file_digest": CALLABLE, "manifest_entry_path": CALLABLE,
        "digest_files": CALLABLE, "write_manifest": CALLABLE, "read_manifest": CALLABLE,
        "verify_directory": CALLABLE, "fsync_dir": CALLABLE, "fsync_tree": CALLABLE, "write_tracker": CALLABLE,
        "exchange_paths": CALLABLE, "replace_dir": CALLABLE, "recover_leftovers": CALLABLE,
        "iteration_dirname": CALLABLE, "iterations_in": CALLABLE, "prepare_save_dir": CALLABLE,
        "publish_iteration": CALLABLE, "tracker_exists": CALLABLE, "read_tracker": CALLABLE,
        "choose_checkpoint": CALLABLE, "MANIFEST_FILENAME": ("value", "integrity_manifest.json"),
        "MANIFEST_VERSION": ("value", 1), "TRACKER_FILENAME": ("value", "latest_checkpointed_iteration.txt"),
        "NON_PERSISTENT_SUBDIR": ("value", "non_persistent")},
    "megatron.training.async_checkpointing": {
        "sharded_state_to_save": CALLABLE, "start_torch_dist_save": CALLABLE, "staging_device": CALLABLE,
        "AsyncTorchDistWriter": CLASS},
    "megatron.training.checkpoint_errors": {
        "CheckpointContentError": CLASS, "is_checkpoint_user_error": CALLABLE,
        "checkpoint_errors_as_user_errors": CALLABLE},
    "megatron.training.legacy_optimizer_state": {
        "OptimizerStateMismatch": CLASS, "to_megatron_layout": CALLABLE, "group_identity": CALLABLE,
        "to_named_layout": CALLABLE, "model_keys_in_order": CALLABLE, "param_shapes_by_name": CALLABLE},
}
MODEL_AND_OPTIMIZER = {"megatron.core.dist_checkpointing.model_and_optimizer": {
    "VOCAB_KEYS": ("value", ("embedding.word_embeddings.weight", "output_layer.weight")),
    "OPTIMIZER_PREFIX": ("value", "optimizer.state."), "LAYER_PREFIX": ("value", "decoder.layers."),
    "MAIN_PARAM": ("value", "fp32_param"), "DISTRIB_OPTIM_SHARDING_TYPE": ("value", "fully_sharded_model_space"),
    "CONTENT_METADATA_KEY": ("value", "content_metadata"),
    "checkpoint_layer_name": CALLABLE, "module_layer_name": CALLABLE, "is_per_layer_layout": CALLABLE,
    "EntryKey": CLASS, "entry_key": CALLABLE, "ParamInfo": CLASS, "param_keys_and_layouts": CALLABLE,
    "extra_state_bytes": CALLABLE, "rng_state_object": CALLABLE, "model_sharded_state": CALLABLE,
    "optimizer_key": CALLABLE, "flattened_shape": CALLABLE, "optimizer_sharded_state": CALLABLE,
    "optimizer_load_plan": CALLABLE, "ensure_optimizer_state": CALLABLE, "optimizer_common_state": CALLABLE,
    "content_metadata": CALLABLE, "saved_groups_and_steps": CALLABLE, "saved_grad_scaler": CALLABLE,
    "load_optimizer_common_state": CALLABLE, "stack_layers": CALLABLE, "unstack_layers": CALLABLE,
    "unflatten_fragments": CALLABLE}}
_PARALLEL_STATE_GETTERS = [
    "get_context_parallel_group", "get_context_parallel_rank", "get_context_parallel_world_size",
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_src_rank",
    "get_data_parallel_world_size", "get_embedding_group", "get_expert_data_parallel_group",
    "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size", "get_expert_model_parallel_group",
    "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group", "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size", "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_parallel_group", "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
    "get_inter_partial_data_parallel_group", "get_model_parallel_group", "get_model_parallel_src_rank",
    "get_model_parallel_world_size", "get_pipeline_model_parallel_first_rank", "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_last_rank", "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank", "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_split_rank", "get_pipeline_model_parallel_world_size",
    "get_position_embedding_group", "get_tensor_and_context_parallel_group", "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size", "get_tensor_and_data_parallel_group",
    "get_tensor_and_data_parallel_rank", "get_tensor_and_data_parallel_world_size",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size", "get_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size"]
ARCHITECTURE = {
    "megatron.core.parallel_state": {"initialize_model_parallel": CALLABLE, "destroy_model_parallel": CALLABLE,
                                     **{name: CALLABLE for name in _PARALLEL_STATE_GETTERS}},
    "megatron.core.tensor_parallel": {
        "ColumnParallelLinear": CLASS, "RowParallelLinear": CLASS, "VocabParallelEmbedding": CLASS,
        "vocab_parallel_cross_entropy": CALLABLE, "get_cuda_rng_tracker": CALLABLE,
        "model_parallel_cuda_manual_seed": CALLABLE},
    "megatron.core.transformer": {"TransformerConfig": CLASS, "TransformerBlock": CLASS, "TransformerLayer": CLASS,
                                  "SelfAttention": CLASS, "MLP": CLASS},
    "megatron.core.transformer.pipeline_layout": {"pipeline_layer_counts": CALLABLE},
    "megatron.core.fusions.fused_bias_activation": {"bias_activation_fused": CALLABLE},
    "megatron.core.fusions.fused_bias_dropout": {"get_bias_dropout_add": CALLABLE},
    "megatron.core.fusions.pointwise": {"fuse_pointwise": CALLABLE},
    "megatron.core.models.gpt": {"GPTModel": CLASS},
    "megatron.core.distributed": {"DistributedDataParallel": CLASS, "DistributedDataParallelConfig": CLASS,
                                  "finalize_model_grads": CALLABLE},
    "megatron.core.optimizer": {"OptimizerConfig": CLASS, "get_megatron_optimizer": CALLABLE,
                                "MegatronOptimizer": CLASS, "DistributedOptimizer": CLASS,
                                "get_optimizer_state_bytes": CALLABLE},
    "megatron.core.optimizer_param_scheduler": {"OptimizerParamScheduler": CLASS},
    "megatron.core.pipeline_parallel": {"get_forward_backward_func": CALLABLE},
    "megatron.core.num_microbatches_calculator": {"get_num_microbatches": CALLABLE,
                                                  "update_num_microbatches": CALLABLE,
                                                  "init_num_microbatches_calculator": CALLABLE},
    "megatron.core.datasets.indexed_dataset": {"IndexedDataset": CLASS, "IndexedDatasetBuilder": CLASS},
    "megatron.core.datasets.gpt_dataset": {"GPTDataset": CLASS},
    "megatron.core.datasets.blended_dataset": {"BlendedDataset": CLASS},
    "megatron.core.datasets.blended_megatron_dataset_builder": {"BlendedMegatronDatasetBuilder": CLASS},
    "megatron.core.tokenizers": {"GPT2BPETokenizer": CLASS, "SentencePieceTokenizer": CLASS,
                                 "HuggingFaceTokenizer": CLASS, "TikTokenizer": CLASS, "NullTokenizer": CLASS},
    "megatron.core.inference": {"sample_logits": CALLABLE},
    "megatron.core.telemetry": {"setup_telemetry": CALLABLE, "managed_span": CALLABLE,
                                "record_training_metrics": CALLABLE},
    "megatron.core.dist_checkpointing": {"ShardedTensor": CLASS, "ShardedObject": CLASS, "TPLayout": CLASS,
                                         "save": CALLABLE, "load": CALLABLE},
    "megatron.core.dist_checkpointing.mapping": {},
    "megatron.core.dist_checkpointing.model_and_optimizer": {"model_sharded_state": CALLABLE,
                                                             "optimizer_sharded_state": CALLABLE},
    "megatron.core.dist_checkpointing.serialization": {},
    "megatron.core.dist_checkpointing.safe_loading": {},
    "megatron.core.step_timing": {"StepTimeRecorder": CLASS, "section": CALLABLE, "TIMER_PARTS": ("type", dict)},
    "megatron.training": {"initialize_megatron": CALLABLE, "pretrain": CALLABLE},
    "megatron.training.arguments": {"parse_args": CALLABLE},
    "megatron.training.initialize": {},
    "megatron.training.training": {},
    "megatron.training.training_log": {},
    "megatron.training.checkpointing": {"save_checkpoint": CALLABLE, "load_checkpoint": CALLABLE},
    "megatron.training.async_checkpointing": {},
    "megatron.training.checkpoint_integrity": {},
    "megatron.training.checkpoint_errors": {},
    "megatron.training.training_state": {"TrainingState": CLASS},
    "megatron.training.telemetry_hooks": {},
    "megatron.training.step_breakdown": {},
    "megatron.training.slurm": {"torch_env_from_slurm": CALLABLE, "torchrun_args_from_slurm": CALLABLE,
                                "expand_nodelist": CALLABLE},
}
TOOL_SCRIPTS = ["tools/preprocess_data.py", "tools/merge_datasets.py", "tools/run_text_generation.py",
                "tools/flags_table.py", "tools/make_tour_data.py", "tools/checkpoint/export_hf.py",
                "tools/checkpoint/import_hf.py", "tools/checkpoint/legacy_checkpoint.py",
                "tools/checkpoint/hf_conversion.py", "tools/checkpoint/convert.py"]


def _cases():
    for group_name, group in [("checkpointing", CHECKPOINTING), ("arguments", ARGUMENTS), ("shims", SHIM_MODULES),
                              ("model_and_optimizer", MODEL_AND_OPTIMIZER), ("architecture", ARCHITECTURE)]:
        for module, names in group.items():
            yield pytest.param(module, names, id=f"{group_name}:{module}")


@pytest.mark.parametrize("module,names", list(_cases()))
def test_old_import_path_still_resolves(module, names):
    imported = importlib.import_module(module)
    wrong = []
    for name, expected in names.items():
        if not hasattr(imported, name):
            wrong.append(f"{name}: missing")
            continue
        value = getattr(imported, name)
        if expected == CLASS and not inspect.isclass(value):
            wrong.append(f"{name}: was a class, now {value!r}")
        elif expected == CALLABLE and (inspect.isclass(value) or not callable(value)):
            wrong.append(f"{name}: was a function, now {value!r}")
        elif isinstance(expected, tuple) and expected[0] == "value" and value != expected[1]:
            wrong.append(f"{name}: was {expected[1]!r}, now {value!r}")
        elif isinstance(expected, tuple) and expected[0] == "type" and not isinstance(value, expected[1]):
            wrong.append(f"{name}: was a {expected[1].__name__}, now {type(value).__name__}")
    assert not wrong, f"from {module}: " + "; ".join(wrong)


def test_the_tools_the_architecture_table_names_exist():
    assert [path for path in TOOL_SCRIPTS if not (REPO / path).is_file()] == []
