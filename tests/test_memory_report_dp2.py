"""The theoretical memory report's optimizer bytes equal those each of 2 gloo ranks measures from its
optimizer's tensors, with and without --use-distributed-optimizer, in fp32 and bf16 (one launch, four layouts)."""
import pytest

from dist_utils import run_distributed

# Sizes that are not multiples of 64 (hidden 36, ffn 100, vocab 1000) and small buckets: the distributed
# optimizer's buffers get padding, which the report ignores.
MODEL = ["--num-layers", "2", "--hidden-size", "36", "--num-attention-heads", "4", "--ffn-hidden-size", "100",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1",
         "--lr", "1e-3", "--use-cpu-initialization", "--make-vocab-size-divisible-by", "1",
         "--overlap-grad-reduce", "--ddp-bucket-size", "3000", "--distributed-backend", "gloo"]
LAYOUTS = {
    "fp32": [], "fp32-distopt": ["--use-distributed-optimizer"],
    "bf16": ["--bf16"], "bf16-distopt": ["--bf16", "--use-distributed-optimizer"],
}


def _measure(rank, world, layouts):
    """Per layout: (bytes measured after one optimizer step, the bytes of Adam's scalar steps among them,
    the report's optimizer bytes, the padded elements of this rank's buffers x report bytes/param)."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.optimizer import get_optimizer_state_bytes
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.theoretical_memory_usage import bytes_per_parameter, compute_weight_and_optimizer_memory
    from megatron.training.tokenizer import _vocab_size_with_padding
    from megatron.training.training import setup_model_and_optimizer

    results = {}
    for name, flags in layouts.items():
        args = validate_args(parse_args(args=[*MODEL, *flags]))
        args.padded_vocab_size = _vocab_size_with_padding(1000, args)
        global_vars.set_global_variables(args, build_tokenizer=False)
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1234)
        model, optimizer, _ = setup_model_and_optimizer(pretrain_gpt.model_provider)
        # Zero grads are grads: the first step creates Adam's states as training would.
        success, _, _ = optimizer.step()
        assert success
        inner = optimizer.optimizer
        step_bytes = sum(v.numel() * v.element_size() for state in inner.state.values()
                         for key, v in state.items() if key == "step")
        per = bytes_per_parameter(args)
        padded = sum(b.grad_data.numel() - b.numel_unpadded for chunk in model for b in chunk.buffers)
        results[name] = (get_optimizer_state_bytes(optimizer), step_bytes,
                         compute_weight_and_optimizer_memory(args).optimizer_bytes,
                         padded * (per.main_param + per.optimizer_state))
        global_vars.destroy_global_variables()
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
    return results


@pytest.mark.timeout(300)
def test_report_matches_measured_optimizer_bytes_at_dp2():
    per_rank = run_distributed(_measure, 2, LAYOUTS, timeout=280)
    for name in LAYOUTS:
        for rank, result in enumerate(per_rank):
            measured, step_bytes, reported, padding = result[name]
            assert step_bytes > 0, (name, rank)
            if "distopt" in name:
                assert padding > 0, name
                assert abs(measured - step_bytes - reported) <= padding, (name, rank, measured, reported)
            else:
                assert measured - step_bytes == reported, (name, rank)
    # The distributed optimizer holds half of the plain layout's state on each rank (up to the padding).
    for precision in ("fp32", "bf16"):
        plain, _, _, _ = per_rank[0][precision]
        sharded, _, _, padding = per_rank[0][precision + "-distopt"]
        assert sharded == pytest.approx(plain / 2, abs=padding + plain * 0.01)
