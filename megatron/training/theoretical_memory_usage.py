"""Megatron's theoretical memory report: weight, gradient and optimizer bytes per rank from the command line."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


# ---------------------------------------------------------------------------------------------------
# Parameter shapes of one (tensor, pipeline) rank
# ---------------------------------------------------------------------------------------------------

def num_layers_on_pipeline_stage(args, pp_rank: int) -> int:
    """Transformer layers held by pipeline stage ``pp_rank`` (all its virtual stages together).

    Even split of ``--num-layers`` over ``--pipeline-model-parallel-size``, or, with
    ``--decoder-first/last-pipeline-num-layers``, those counts on the first/last stage and the rest
    split evenly over the others (Megatron's uneven split).
    """
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        return args.num_layers
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if first is None and last is None:
        return args.num_layers // pp
    middle_stages = pp - (first is not None) - (last is not None)
    remaining = args.num_layers - (first or 0) - (last or 0)
    if pp_rank == 0 and first is not None:
        return first
    if pp_rank == pp - 1 and last is not None:
        return last
    return remaining // middle_stages if middle_stages else 0


def _query_groups(args) -> int:
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def _norm_shapes(args, prefix: str, size: int) -> List[Tuple[str, Tuple[int, ...]]]:
    shapes = [(f"{prefix}.weight", (size,))]
    if args.normalization == "LayerNorm":  # RMSNorm has no bias
        shapes.append((f"{prefix}.bias", (size,)))
    return shapes


def _layer_shapes(args, index: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """One transformer layer on one TP rank, in ``named_parameters`` order."""
    tp, h = args.tensor_model_parallel_size, args.hidden_size
    q = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * _query_groups(args)
    ffn_out = args.ffn_hidden_size * (2 if args.swiglu else 1)  # SwiGLU: gate and up fused in fc1
    bias = args.add_bias_linear
    p = f"decoder.layers.{index}"
    shapes = _norm_shapes(args, f"{p}.input_layernorm", h)
    shapes.append((f"{p}.self_attention.linear_qkv.weight", ((q + 2 * kv) // tp, h)))
    if bias or getattr(args, "add_qkv_bias", False):
        shapes.append((f"{p}.self_attention.linear_qkv.bias", ((q + 2 * kv) // tp,)))
    shapes.append((f"{p}.self_attention.linear_proj.weight", (h, q // tp)))
    if bias:  # row-parallel bias: replicated over TP
        shapes.append((f"{p}.self_attention.linear_proj.bias", (h,)))
    if getattr(args, "qk_layernorm", False):
        shapes += _norm_shapes(args, f"{p}.self_attention.q_layernorm", args.kv_channels)
        shapes += _norm_shapes(args, f"{p}.self_attention.k_layernorm", args.kv_channels)
    shapes += _norm_shapes(args, f"{p}.pre_mlp_layernorm", h)
    shapes.append((f"{p}.mlp.linear_fc1.weight", (ffn_out // tp, h)))
    if bias:
        shapes.append((f"{p}.mlp.linear_fc1.bias", (ffn_out // tp,)))
    shapes.append((f"{p}.mlp.linear_fc2.weight", (h, args.ffn_hidden_size // tp)))
    if bias:
        shapes.append((f"{p}.mlp.linear_fc2.bias", (h,)))
    return shapes


def gpt_parameter_shapes(args, pp_rank: int = 0) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(name, shape)`` of every parameter a TP rank of pipeline stage ``pp_rank`` holds.

    Names and order are those of ``GPTModel.named_parameters()`` (layer indices local to the
    stage). Every TP rank of a stage holds the same shapes: split weights are ``1/TP`` of the
    full ones, norms, row-parallel biases and position embeddings are replicated. The vocabulary
    is ``args.padded_vocab_size`` (``--make-vocab-size-divisible-by`` x TP). With tied embeddings
    and PP > 1 the last stage holds its own copy of the word embeddings as ``output_layer.weight``.
    """
    tp, h, pp = args.tensor_model_parallel_size, args.hidden_size, args.pipeline_model_parallel_size
    first, last = pp_rank == 0, pp_rank == pp - 1
    shapes = []
    if first:
        shapes.append(("embedding.word_embeddings.weight", (args.padded_vocab_size // tp, h)))
        if args.position_embedding_type == "learned_absolute":
            shapes.append(("embedding.position_embeddings.weight", (args.max_position_embeddings, h)))
    for index in range(num_layers_on_pipeline_stage(args, pp_rank)):
        shapes += _layer_shapes(args, index)
    if last:
        shapes += _norm_shapes(args, "decoder.final_layernorm", h)
        if args.untie_embeddings_and_output_weights or not first:
            shapes.append(("output_layer.weight", (args.padded_vocab_size // tp, h)))
    return shapes


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def num_parameters_on_rank(args, pp_rank: int = 0) -> int:
    """Parameters held by one TP rank of pipeline stage ``pp_rank``."""
    return sum(_numel(shape) for _, shape in gpt_parameter_shapes(args, pp_rank))


def num_parameters_in_model(args) -> int:
    """Parameters of the whole model (tied embeddings counted once), independent of TP and PP."""
    h = args.hidden_size
    q = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * _query_groups(args)
    ffn_out = args.ffn_hidden_size * (2 if args.swiglu else 1)
    norm = h * (2 if args.normalization == "LayerNorm" else 1)
    layer = 2 * norm + h * (q + 2 * kv) + q * h + ffn_out * h + args.ffn_hidden_size * h
    if args.add_bias_linear or getattr(args, "add_qkv_bias", False):
        layer += q + 2 * kv
    if args.add_bias_linear:
        layer += h + ffn_out + h
    if getattr(args, "qk_layernorm", False):
        layer += 2 * args.kv_channels * (2 if args.normalization == "LayerNorm" else 1)
    embedding = args.padded_vocab_size * h
    total = layer * args.num_layers + norm + embedding * (2 if args.untie_embeddings_and_output_weights else 1)
    if args.position_embedding_type == "learned_absolute":
        total += args.max_position_embeddings * h
    return total


# ---------------------------------------------------------------------------------------------------
# Bytes per parameter and per rank
# ---------------------------------------------------------------------------------------------------

@dataclass
class BytesPerParameter:
    """Bytes each parameter costs on a rank.

    ``weight`` is the model param (2 for bf16/fp16, 4 for fp32), ``gradient`` the grad buffer's
    element (``main_grad``: 4 when reduced in fp32), ``main_param`` the fp32 master copy that
    mixed precision keeps (0 for fp32 training, where the optimizer updates the model params),
    ``optimizer_state`` the inner optimizer's fp32 states (Adam: exp_avg + exp_avg_sq = 8; SGD
    with momentum: 4). ``shards`` is the number of ranks the main params and states are split
    over: the data-parallel (x context-parallel) size with ``--use-distributed-optimizer``, else 1.
    """

    weight: int
    gradient: int
    main_param: int
    optimizer_state: int
    shards: int

    @property
    def optimizer(self) -> float:
        """Main param + optimizer state bytes per parameter on one rank (sharded)."""
        return (self.main_param + self.optimizer_state) / self.shards

    @property
    def total(self) -> float:
        """Weight + gradient + optimizer bytes per parameter on one rank: Megatron's 18 for bf16
        with fp32 grads and Adam, ``6 + 12 / DP`` with the distributed optimizer."""
        return self.weight + self.gradient + self.optimizer


def bytes_per_parameter(args) -> BytesPerParameter:
    """Bytes per parameter for the precision, grad-reduction dtype, optimizer and sharding of ``args``."""
    half = args.fp16 or args.bf16
    weight = 2 if half else 4
    gradient = 4 if (not half or args.accumulate_allreduce_grads_in_fp32) else 2
    if args.optimizer == "adam":
        state = 8
    elif args.optimizer == "sgd":
        state = 4 if args.sgd_momentum else 0
    else:
        raise ValueError(f"--optimizer {args.optimizer}: no memory model for this optimizer")
    shards = 1
    if args.use_distributed_optimizer:
        shards = args.data_parallel_size * getattr(args, "context_parallel_size", 1)
    return BytesPerParameter(weight=weight, gradient=gradient, main_param=4 if half else 0,
                             optimizer_state=state, shards=shards)


@dataclass
class MemoryFootprint:
    """Theoretical bytes on the most loaded rank (the pipeline stage holding the most parameters)."""

    num_parameters: int
    num_parameters_on_rank: int
    pp_rank: int
    weight_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: Optional[float] = None

    @property
    def weight_and_optimizer_bytes(self) -> float:
        """Weights + gradients + optimizer (Megatron's 'weight and optimizer' figure)."""
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def compute_weight_and_optimizer_memory(args, pp_rank: Optional[int] = None) -> MemoryFootprint:
    """Weight, gradient and optimizer bytes of one rank of stage ``pp_rank`` (default: the most loaded).

    Unlike Megatron-LM's estimate, the parameter count is exact for this project's GPT: it counts
    biases, learned position embeddings and the per-rank split of each tensor (replicated norms
    and row-parallel biases are not divided by TP). The bytes ignore the distributed optimizer's
    bucket padding (at most one bucket's ``lcm(DP, 128)`` elements per bucket).
    """
    stages = range(args.pipeline_model_parallel_size) if pp_rank is None else [pp_rank]
    counts = {stage: num_parameters_on_rank(args, stage) for stage in stages}
    stage = max(counts, key=lambda s: counts[s])
    n = counts[stage]
    per = bytes_per_parameter(args)
    return MemoryFootprint(num_parameters=num_parameters_in_model(args), num_parameters_on_rank=n, pp_rank=stage,
                           weight_bytes=n * per.weight, gradient_bytes=n * per.gradient,
                           optimizer_bytes=n * per.optimizer)


def compute_activation_memory(args, num_microbatches: Optional[int]) -> float:
    """Activation bytes on the first pipeline stage with sequence parallelism and selective recompute.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    Table 2: ``s*b*h*(18 + 4*f/h)`` bytes per layer with selective recompute (34 s*b*h for f = 4h),
    divided by TP under sequence parallelism, plus the embedding input (8 s*b bytes) and its dropout
    mask (s*b*h) for each of PP in-flight microbatches and, without PP, the output layer and loss
    inputs (4 s*b*h*(1 + V/h)). Non-interleaved PP keeps at most min(PP, microbatches) in flight.
    """
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    per_layer = s * b * h * (18 + 4 * args.ffn_hidden_size / h)
    total = per_layer * args.num_layers + 8 * s * b * pp + s * b * h * pp
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vp is not None:
        total *= 1 + (pp - 1) / (pp * vp)  # interleaved schedule holds more microbatches in flight
    elif pp > 1 and num_microbatches is not None:
        total *= min(1.0, num_microbatches / pp)
    if pp == 1:
        total += s * b * h * 4 * (1 + args.padded_vocab_size / h)
    return total / tp


def report_theoretical_memory(args, num_microbatches: Optional[int] = None, verbose: bool = False) -> MemoryFootprint:
    """Print Megatron's "Theoretical memory footprints" line (call on one rank) and return the footprint.

    The line is ``Theoretical memory footprints: weight and optimizer=X MB`` and, with
    ``--sequence-parallel`` and ``--recompute-granularity selective`` (the only case the activation
    formula covers), ``, activation=Y MB, total=Z MB``. ``verbose`` adds the parameter counts and the
    weight / gradient / optimizer split.
    """
    footprint = compute_weight_and_optimizer_memory(args)
    if verbose:
        per = bytes_per_parameter(args)
        print(f"Total number of parameters in billions: {footprint.num_parameters / 10 ** 9:.2f}", flush=True)
        print(f"Number of parameters in most loaded shard in billions: "
              f"{footprint.num_parameters_on_rank / 10 ** 9:.4f}", flush=True)
        print(f"Theoretical bytes per parameter: weight={per.weight} gradient={per.gradient} "
              f"optimizer={per.optimizer:.4g} (main params and states over {per.shards} shard(s)), "
              f"total={per.total:.4g}; per rank: weight={footprint.weight_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB, "
              f"gradient={footprint.gradient_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB, "
              f"optimizer={footprint.optimizer_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB", flush=True)
    weight_and_optimizer = footprint.weight_and_optimizer_bytes / NUM_BYTES_IN_MEGABYTE
    if not (args.sequence_parallel and args.recompute_granularity == "selective"):
        print(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB", flush=True)
        return footprint
    footprint.activation_bytes = compute_activation_memory(args, num_microbatches)
    activation = footprint.activation_bytes / NUM_BYTES_IN_MEGABYTE
    print(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB, "
          f"activation={activation:.2f} MB, total={weight_and_optimizer + activation:.2f} MB\n", flush=True)
    return footprint
