"""Megatron's theoretical memory report: weight, gradient, optimizer and activation bytes per rank of a config."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.core.console import write_line
from megatron.core.transformer.pipeline_layout import pipeline_layer_counts, pipeline_layer_offset
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.config.container import PretrainConfigContainer

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def as_config(config) -> PretrainConfigContainer:
    """``config`` itself when it is a ``PretrainConfigContainer``; validated ``args`` (the Megatron-style
    callers: tools and tests that hold a checkpoint's or a command line's args) are converted once.

    Every function of this module takes either; only the model, parallel, precision, optimizer, batch
    and sequence settings are read (``model``, ``gpt``, ``tokenizer.padded_vocab_size``, ``optimizer``,
    ``ddp``, ``dist.data_parallel_size``, ``train.micro_batch_size``, ``data.seq_length``).
    """
    if isinstance(config, PretrainConfigContainer):
        return config
    return pretrain_cfg_container_from_args(config, with_telemetry=False)


# ---------------------------------------------------------------------------------------------------
# Parameter shapes of one (tensor, pipeline) rank
# ---------------------------------------------------------------------------------------------------

def stage_layer_numbers(config, pp_rank: int) -> List[int]:
    """1-based global numbers of the transformer layers held by pipeline stage ``pp_rank``, chunk by
    chunk (all its virtual stages), as the model builds them (``pipeline_layout``: even split,
    ``--decoder-first/last-pipeline-num-layers``, account-for-embedding/loss). Raises ValueError for a
    split that does not add up."""
    model = as_config(config).model
    counts = pipeline_layer_counts(
        model.num_layers, model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size,
        model.num_layers_in_first_pipeline_stage, model.num_layers_in_last_pipeline_stage,
        model.account_for_embedding_in_pipeline_split, model.account_for_loss_in_pipeline_split)
    numbers = []
    for vp_stage, count in enumerate(counts[pp_rank]):
        offset = pipeline_layer_offset(counts, pp_rank, vp_stage)
        numbers += range(offset + 1, offset + count + 1)
    return numbers


def num_layers_on_pipeline_stage(config, pp_rank: int) -> int:
    """Transformer layers held by pipeline stage ``pp_rank`` (all its virtual stages together); see
    :func:`stage_layer_numbers`."""
    return len(stage_layer_numbers(config, pp_rank))


def _query_groups(model) -> int:
    # TransformerConfig fills num_query_groups = heads without --group-query-attention.
    return model.num_query_groups or model.num_attention_heads


def _norm_shapes(model, prefix: str, size: int) -> List[Tuple[str, Tuple[int, ...]]]:
    shapes = [(f"{prefix}.weight", (size,))]
    if model.normalization == "LayerNorm":  # RMSNorm has no bias
        shapes.append((f"{prefix}.bias", (size,)))
    return shapes


def _moe_mlp_shapes(model, p: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """The MoE MLP of one layer on one (TP, EP, ETP) rank, in ``named_parameters`` order: the router's
    ``[E, h]`` weight (replicated), this EP rank's ``E / EP`` experts (SwiGLU fc1 ``[2F / ETP, h]`` and fc2
    ``[h, F / ETP]`` each, or GroupedMLP's ``weight1`` / ``weight2`` holding them all) and the shared
    expert (an MLP of width ``moe_shared_expert_intermediate_size`` split over TP). MoE has no linear
    biases (``TransformerConfig`` refuses them)."""
    tp, h = model.tensor_model_parallel_size, model.hidden_size
    etp, ep = model.expert_tensor_parallel_size, model.expert_model_parallel_size
    gate = 2 if model.gated_linear_unit else 1
    f = model.moe_ffn_hidden_size
    local_experts = model.num_moe_experts // ep
    shapes = [(f"{p}.mlp.router.weight", (model.num_moe_experts, h))]
    if model.moe_grouped_gemm:
        shapes.append((f"{p}.mlp.experts.weight1", (h, local_experts * gate * f // etp)))
        shapes.append((f"{p}.mlp.experts.weight2", (local_experts * f // etp, h)))
    else:
        for j in range(local_experts):
            shapes.append((f"{p}.mlp.experts.local_experts.{j}.linear_fc1.weight", (gate * f // etp, h)))
            shapes.append((f"{p}.mlp.experts.local_experts.{j}.linear_fc2.weight", (h, f // etp)))
    shared = model.moe_shared_expert_intermediate_size
    if shared:
        shapes.append((f"{p}.mlp.shared_experts.linear_fc1.weight", (gate * shared // tp, h)))
        shapes.append((f"{p}.mlp.shared_experts.linear_fc2.weight", (h, shared // tp)))
    return shapes


def _is_expert_parameter(name: str) -> bool:
    """Whether ``name`` is a routed expert's parameter (sharded over EP x ETP, reduced over expert-DP)."""
    return ".mlp.experts." in name


def _layer_shapes(model, index: int, layer_number: Optional[int] = None) -> List[Tuple[str, Tuple[int, ...]]]:
    """One transformer layer on one TP rank, in ``named_parameters`` order (``model``: a TransformerConfig).

    ``index`` is the layer's index on its stage (the name), ``layer_number`` its 1-based global number
    (whether ``moe_layer_freq`` makes its MLP an MoE; default ``index + 1``).
    """
    tp, h = model.tensor_model_parallel_size, model.hidden_size
    q = model.kv_channels * model.num_attention_heads
    kv = model.kv_channels * _query_groups(model)
    ffn_out = model.ffn_hidden_size * (2 if model.gated_linear_unit else 1)  # SwiGLU: gate and up fused in fc1
    bias = model.add_bias_linear
    p = f"decoder.layers.{index}"
    shapes = _norm_shapes(model, f"{p}.input_layernorm", h)
    # megatron-core creates linear_proj before linear_qkv; the legacy optimizer state follows this order
    shapes.append((f"{p}.self_attention.linear_proj.weight", (h, q // tp)))
    if bias:  # row-parallel bias: replicated over TP
        shapes.append((f"{p}.self_attention.linear_proj.bias", (h,)))
    shapes.append((f"{p}.self_attention.linear_qkv.weight", ((q + 2 * kv) // tp, h)))
    if bias or model.add_qkv_bias:
        shapes.append((f"{p}.self_attention.linear_qkv.bias", ((q + 2 * kv) // tp,)))
    if model.qk_layernorm:
        shapes += _norm_shapes(model, f"{p}.self_attention.q_layernorm", model.kv_channels)
        shapes += _norm_shapes(model, f"{p}.self_attention.k_layernorm", model.kv_channels)
    shapes += _norm_shapes(model, f"{p}.pre_mlp_layernorm", h)
    if model.is_moe_layer(index + 1 if layer_number is None else layer_number):
        return shapes + _moe_mlp_shapes(model, p)
    shapes.append((f"{p}.mlp.linear_fc1.weight", (ffn_out // tp, h)))
    if bias:
        shapes.append((f"{p}.mlp.linear_fc1.bias", (ffn_out // tp,)))
    shapes.append((f"{p}.mlp.linear_fc2.weight", (h, model.ffn_hidden_size // tp)))
    if bias:
        shapes.append((f"{p}.mlp.linear_fc2.bias", (h,)))
    return shapes


def gpt_parameter_shapes(config, pp_rank: int = 0) -> List[Tuple[str, Tuple[int, ...]]]:
    """``(name, shape)`` of every parameter a TP rank of pipeline stage ``pp_rank`` holds.

    Names and order are those of ``GPTModel.named_parameters()`` (layer indices local to the
    stage). Every TP rank of a stage holds the same shapes: split weights are ``1/TP`` of the
    full ones, norms, row-parallel biases and position embeddings are replicated. An MoE layer holds
    the router and ``1/EP`` of the experts, each split over ETP (:func:`_moe_mlp_shapes`). The vocabulary
    is ``tokenizer.padded_vocab_size`` (``--make-vocab-size-divisible-by`` x TP). With tied embeddings
    and PP > 1 the last stage holds its own copy of the word embeddings as ``output_layer.weight``.
    """
    cfg = as_config(config)
    model, gpt, vocab = cfg.model, cfg.gpt, cfg.tokenizer.padded_vocab_size
    tp, h, pp = model.tensor_model_parallel_size, model.hidden_size, model.pipeline_model_parallel_size
    first, last = pp_rank == 0, pp_rank == pp - 1
    shapes = []
    if first:
        shapes.append(("embedding.word_embeddings.weight", (vocab // tp, h)))
        if gpt.position_embedding_type == "learned_absolute":
            shapes.append(("embedding.position_embeddings.weight", (gpt.max_position_embeddings, h)))
    for index, number in enumerate(stage_layer_numbers(cfg, pp_rank)):
        shapes += _layer_shapes(model, index, number)
    if last:
        shapes += _norm_shapes(model, "decoder.final_layernorm", h)
        if gpt.untie_embeddings_and_output_weights or not first:
            shapes.append(("output_layer.weight", (vocab // tp, h)))
    return shapes


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def num_parameters_on_rank(config, pp_rank: int = 0) -> int:
    """Parameters held by one TP rank of pipeline stage ``pp_rank``."""
    return sum(_numel(shape) for _, shape in gpt_parameter_shapes(config, pp_rank))


def num_expert_parameters_on_rank(config, pp_rank: int = 0) -> int:
    """Of :func:`num_parameters_on_rank`, the routed experts' parameters (0 without MoE)."""
    return sum(_numel(shape) for name, shape in gpt_parameter_shapes(config, pp_rank) if _is_expert_parameter(name))


def _moe_mlp_parameters(model, experts: int) -> int:
    """Parameters of one MoE MLP with ``experts`` routed experts counted (all of them, or top-k for the
    active ones): the router, the experts and the shared expert."""
    gate = 2 if model.gated_linear_unit else 1
    h, f = model.hidden_size, model.moe_ffn_hidden_size
    shared = model.moe_shared_expert_intermediate_size or 0
    return model.num_moe_experts * h + experts * (gate + 1) * f * h + (gate + 1) * shared * h


def _num_moe_layers(model) -> int:
    return 0 if model.num_moe_experts is None else sum(
        1 for number in range(1, model.num_layers + 1) if model.is_moe_layer(number))


def _num_routed_expert_parameters(model) -> int:
    """Parameters of all routed experts of the model (every MoE layer, every expert)."""
    gate = 2 if model.gated_linear_unit else 1
    return _num_moe_layers(model) * model.num_moe_experts * (gate + 1) * model.moe_ffn_hidden_size * model.hidden_size


def num_parameters_in_model(config, active: bool = False) -> int:
    """Parameters of the whole model (tied embeddings counted once), independent of TP, PP and EP.

    Every expert counts unless ``active``: then an MoE layer counts the ``moe_router_topk`` experts a
    token runs through (with the router and the shared expert), Megatron-LM's "active parameters".
    """
    cfg = as_config(config)
    model, gpt = cfg.model, cfg.gpt
    h = model.hidden_size
    q = model.kv_channels * model.num_attention_heads
    kv = model.kv_channels * _query_groups(model)
    ffn_out = model.ffn_hidden_size * (2 if model.gated_linear_unit else 1)
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    dense_mlp = ffn_out * h + model.ffn_hidden_size * h
    layer = 2 * norm + h * (q + 2 * kv) + q * h + dense_mlp
    moe_layers = _num_moe_layers(model)
    if model.add_bias_linear or model.add_qkv_bias:
        layer += q + 2 * kv
    if model.add_bias_linear:
        layer += h + ffn_out + h
    if model.qk_layernorm:
        layer += 2 * model.kv_channels * (2 if model.normalization == "LayerNorm" else 1)
    embedding = cfg.tokenizer.padded_vocab_size * h
    total = layer * model.num_layers + norm + embedding * (2 if gpt.untie_embeddings_and_output_weights else 1)
    if moe_layers:  # no linear biases with MoE (TransformerConfig refuses them)
        experts = model.moe_router_topk if active else model.num_moe_experts
        total += moe_layers * (_moe_mlp_parameters(model, experts) - dense_mlp)
    if gpt.position_embedding_type == "learned_absolute":
        total += gpt.max_position_embeddings * h
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
    over: the data-parallel (x context-parallel) size with ``--use-distributed-optimizer``, else 1;
    for routed experts' parameters the expert-data-parallel size, ``world / (ETP x EP x PP)``.
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


def expert_data_parallel_size(config) -> int:
    """Ranks holding the same experts: ``world / (ETP x EP x PP)`` = ``TP x DP x CP / (ETP x EP)``
    (Megatron's expert-data-parallel group; the data-parallel x CP size without MoE)."""
    cfg = as_config(config)
    model = cfg.model
    ranks = model.tensor_model_parallel_size * cfg.dist.data_parallel_size * model.context_parallel_size
    return max(1, ranks // (model.expert_tensor_parallel_size * model.expert_model_parallel_size))


def bytes_per_parameter(config, expert: bool = False) -> BytesPerParameter:
    """Bytes per parameter for the precision, grad-reduction dtype, optimizer and sharding of ``config``;
    ``expert``: of a routed expert's parameter (the distributed optimizer shards it over expert-DP)."""
    cfg = as_config(config)
    optimizer = cfg.optimizer
    half = cfg.model.fp16 or cfg.model.bf16
    weight = 2 if half else 4
    gradient = 4 if (not half or cfg.ddp.grad_reduce_in_fp32) else 2
    if optimizer.optimizer == "adam":
        state = 8
    elif optimizer.optimizer == "sgd":
        state = 4 if optimizer.sgd_momentum else 0
    else:
        raise ValueError(f"--optimizer {optimizer.optimizer}: no memory model for this optimizer")
    shards = 1
    if optimizer.use_distributed_optimizer:
        shards = (expert_data_parallel_size(cfg) if expert
                  else cfg.dist.data_parallel_size * cfg.model.context_parallel_size)
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
    num_expert_parameters_on_rank: int = 0
    num_active_parameters: Optional[int] = None

    @property
    def weight_and_optimizer_bytes(self) -> float:
        """Weights + gradients + optimizer (Megatron's 'weight and optimizer' figure)."""
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def compute_weight_and_optimizer_memory(config, pp_rank: Optional[int] = None) -> MemoryFootprint:
    """Weight, gradient and optimizer bytes of one rank of stage ``pp_rank`` (default: the most loaded).

    Unlike Megatron-LM's estimate, the parameter count is exact for this project's GPT: it counts
    biases, learned position embeddings and the per-rank split of each tensor (replicated norms
    and row-parallel biases are not divided by TP). With MoE every expert counts for memory, each rank
    holding ``1/EP`` of them split over ETP, and with ``--use-distributed-optimizer`` the experts' main
    params and states are sharded over the expert-data-parallel group (as Megatron-LM's estimate does
    since its EP-aware revision, NVIDIA/Megatron-LM#4687; core_v0.14's divided experts by TP alone).
    The bytes ignore the distributed optimizer's bucket padding (at most one bucket's ``lcm(DP, 128)``
    elements per bucket).
    """
    cfg = as_config(config)
    stages = range(cfg.model.pipeline_model_parallel_size) if pp_rank is None else [pp_rank]
    counts = {stage: num_parameters_on_rank(cfg, stage) for stage in stages}
    stage = max(counts, key=lambda s: counts[s])
    n = counts[stage]
    n_expert = num_expert_parameters_on_rank(cfg, stage) if cfg.model.num_moe_experts is not None else 0
    per, per_expert = bytes_per_parameter(cfg), bytes_per_parameter(cfg, expert=True)
    return MemoryFootprint(num_parameters=num_parameters_in_model(cfg), num_parameters_on_rank=n, pp_rank=stage,
                           weight_bytes=n * per.weight, gradient_bytes=n * per.gradient,
                           optimizer_bytes=(n - n_expert) * per.optimizer + n_expert * per_expert.optimizer,
                           num_expert_parameters_on_rank=n_expert,
                           num_active_parameters=num_parameters_in_model(cfg, active=True))


# Attention kernels that never materialise the [s, s] scores: they keep their output and a row
# log-sum-exp (fp32) for the backward. ``auto`` picks one of them on a GPU (and on the CPU without dropout).
_FLASH_LIKE_BACKENDS = ("flash", "fused", "auto")


def _activation_bytes_per_element(model) -> int:
    return 2 if (model.fp16 or model.bf16) else 4


def activation_memory_per_layer(config, recompute: bool = False, moe: bool = False) -> float:
    """Bytes one transformer layer keeps for its backward, for one micro-batch on one TP rank.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    section 4.1, with f = ffn_hidden_size, a = heads, 2-byte activations and 1-byte dropout masks:

    - kept whole on every TP rank unless ``--sequence-parallel`` splits them (then / TP): the
      inputs of both norms and of linear_qkv and linear_fc1 (4 x 2sbh) and the two hidden-dropout
      masks (2 x sbh, only when ``--hidden-dropout`` > 0): the paper's 10 sbh;
    - split over TP: Q, K, V (2sb(q + 2kv), 6 sbh for multi-head attention), linear_proj's
      input (2sbh), the activation's input and linear_fc2's input (2sbf each, 8 sbh each at
      f = 4h; SwiGLU keeps both halves of linear_fc1's output, 2sb * 2f, and their product, 2sbf):
      the paper's 24 sbh;
    - the core attention: with ``--attention-backend unfused``/``local`` the paper's 5 a s^2 b
      (softmax output, dropout mask and dropout output; PyTorch's math kernel keeps fp32 copies,
      so this is a lower bound there); with flash/fused/auto kernels no [s, s] term, only the
      fp32 log-sum-exp (4 a s b; linear_proj's input is a view of their output, counted above).

    Together 34 sbh + 5 a s^2 b for f = 4h with dropout (the paper's eq. 1), 34 sbh with
    flash attention. ``recompute`` (``--recompute-granularity selective``) drops the core
    attention term. fp32 training (no --bf16/--fp16) doubles every 2-byte term. With context parallelism
    each rank holds ``s / CP`` tokens: every per-token term is divided by CP, and the [s, s] term becomes
    the local queries against all keys, ``a (s / CP) s b``.

    ``moe``: the layer's MLP is an MoE (an estimate for balanced routing, no capacity padding). Its
    router keeps fp32 logits and probabilities (2 x 4sbE, of the local tokens); this rank's experts
    receive on average ``s b k`` token copies (k = ``moe_router_topk``: the tokens of the TP x EP group
    routed to its ``E / EP`` experts) and keep their input and output (2 x 2sbkh, the output for the
    weighted combine) and, split over ETP, fc1's output and the activation's (2sbk x 3F for SwiGLU, x 2F
    else); the shared expert is a dense MLP of its width over TP. These replace the dense MLP's inner
    terms.
    """
    cfg = as_config(config)
    model = cfg.model
    cp = max(1, model.context_parallel_size)
    s, b, h = cfg.data.seq_length // cp, cfg.train.micro_batch_size, model.hidden_size
    tp = model.tensor_model_parallel_size
    e = _activation_bytes_per_element(model)
    mask = 1 if model.hidden_dropout > 0 else 0
    q = model.kv_channels * model.num_attention_heads
    kv = model.kv_channels * _query_groups(model)
    f = model.ffn_hidden_size
    gate = 3 if model.gated_linear_unit else 2
    mlp_inner = e * s * b * gate * f  # activation input(s) + output
    whole = 4 * e * s * b * h + 2 * mask * s * b * h
    experts = 0.0  # per rank already (tokens of the TP x EP group): not divided by TP below
    if moe:
        k, etp = model.moe_router_topk, model.expert_tensor_parallel_size
        local_tokens = s * b / (tp if model.sequence_parallel else 1)
        experts = (2 * 4 * local_tokens * model.num_moe_experts  # router logits and probs (fp32)
                   + 2 * e * s * b * k * h + e * s * b * k * gate * model.moe_ffn_hidden_size / etp)
        mlp_inner = e * s * b * gate * (model.moe_shared_expert_intermediate_size or 0)
    split = e * s * b * (q + 2 * kv) + e * s * b * q + mlp_inner
    if not recompute:
        a = model.num_attention_heads
        backend = str(model.attention_backend).rsplit(".", 1)[-1]
        if backend in _FLASH_LIKE_BACKENDS:
            split += 4 * a * s * b
        else:
            dropout = 1 if model.attention_dropout > 0 else 0
            # softmax output, and with dropout its mask (1 byte) and output
            split += a * s * (s * cp) * b * (e + dropout * (1 + e))
    if model.sequence_parallel:
        return (whole + split) / tp + experts
    return whole + split / tp + experts


def _layers_activation_memory(cfg, layer_numbers: List[int]) -> float:
    """Bytes the transformer layers of one stage keep for one micro-batch, with activation recompute.

    Full recompute keeps each checkpointed unit's input (2sbh, / TP under sequence parallelism) and,
    in the backward, one unit recomputed whole; ``block`` checkpoints only the first
    ``--recompute-num-layers`` layers, ``uniform`` every unit of that many layers.
    """
    model = cfg.model
    granularity = model.recompute_granularity
    per_layer = [activation_memory_per_layer(cfg, recompute=granularity == "selective",
                                             moe=model.is_moe_layer(number)) for number in layer_numbers]
    num_layers = len(per_layer)
    if granularity != "full":
        return sum(per_layer)
    unit_input = (_activation_bytes_per_element(model) * (cfg.data.seq_length // max(1, model.context_parallel_size))
                  * cfg.train.micro_batch_size * model.hidden_size)
    if model.sequence_parallel:
        unit_input /= model.tensor_model_parallel_size
    n = min(max(model.recompute_num_layers or 1, 1), num_layers)
    if model.recompute_method == "block":
        return n * unit_input + sum(per_layer[n:]) + (max(per_layer[:n]) if n else 0)
    return -(-num_layers // n) * unit_input + n * max(per_layer, default=0.0)


def compute_activation_memory(config, num_microbatches: Optional[int]) -> float:
    """Activation bytes on the first pipeline stage (the one with the most micro-batches in flight).

    Per micro-batch: the layers of the stage (:func:`activation_memory_per_layer`, with
    ``--recompute-granularity``), the input ids (8sb), the embedding dropout mask (sbh, with
    dropout) and, under sequence parallelism, the whole embedding output (the first layer's shard
    is a view of it). Non-interleaved 1F1B keeps min(PP, micro-batches) in flight on the first stage; the
    interleaved schedule holds ``1 + (PP - 1) / (PP * VP)`` times more. Without PP the stage also
    holds the output side: the final norm's and output layer's inputs (4sbh with 2-byte
    activations) and the fp32 logits the loss keeps (4sbV / TP). With ``--sequence-parallel`` and
    selective recompute this is Megatron-LM's own estimate (Korthikanti et al. Table 2,
    ``sbh(18 + 4f/h)`` per layer over TP). Context parallelism divides the sequence: ``s`` is ``s / CP``.
    """
    cfg = as_config(config)
    model = cfg.model
    s, b, h = cfg.data.seq_length // max(1, model.context_parallel_size), cfg.train.micro_batch_size, model.hidden_size
    pp, tp = model.pipeline_model_parallel_size, model.tensor_model_parallel_size
    layers = _layers_activation_memory(cfg, stage_layer_numbers(cfg, 0))
    e = _activation_bytes_per_element(model)
    embedding = 8 * s * b + (s * b * h if model.hidden_dropout > 0 else 0)
    if model.sequence_parallel:
        # The first layer's norm keeps its shard as a view of the whole embedding output, which so
        # stays alive: (1 - 1/TP) of it beyond the layers' count.
        embedding = 8 * s * b + (s * b * h / tp if model.hidden_dropout > 0 else 0) + e * s * b * h * (1 - 1 / tp)
    total = (layers + embedding) * pp
    vp = model.virtual_pipeline_model_parallel_size
    if vp is not None:
        total *= 1 + (pp - 1) / (pp * vp)  # interleaved schedule holds more microbatches in flight
    elif pp > 1 and num_microbatches is not None:
        total *= min(1.0, num_microbatches / pp)
    if pp == 1:
        total += (2 * e * s * b * h / (tp if model.sequence_parallel else 1)
                  + 4 * s * b * cfg.tokenizer.padded_vocab_size / tp)
    return total


def report_theoretical_memory(config, num_microbatches: Optional[int] = None, verbose: bool = False) -> MemoryFootprint:
    """Print Megatron's "Theoretical memory footprints" line (call on one rank) and return the footprint.

    The line is ``Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB, total=Z MB``.
    Megatron-LM prints the activation part only with ``--sequence-parallel`` and selective recompute;
    here it is estimated for every layout (:func:`compute_activation_memory`), since without it the
    figure misses most of the peak (for GPT-3 XL at micro-batch 16, seq 2048: about 60 of 85 GB).
    ``verbose`` adds the parameter counts, the weight / gradient / optimizer split and the
    activation bytes per layer.
    """
    cfg = as_config(config)
    footprint = compute_weight_and_optimizer_memory(cfg)
    footprint.activation_bytes = compute_activation_memory(cfg, num_microbatches)
    if verbose:
        per = bytes_per_parameter(cfg)
        write_line(f"Total number of parameters in billions: {footprint.num_parameters / 10 ** 9:.2f}")
        if cfg.model.num_moe_experts is not None:
            write_line(f"Total number of active parameters in billions: "
                       f"{footprint.num_active_parameters / 10 ** 9:.2f}")
        write_line(f"Number of parameters in most loaded shard in billions: "
                   f"{footprint.num_parameters_on_rank / 10 ** 9:.4f}")
        write_line(f"Theoretical bytes per parameter: weight={per.weight} gradient={per.gradient} "
                   f"optimizer={per.optimizer:.4g} (main params and states over {per.shards} shard(s)"
                   + (f"; experts' over {bytes_per_parameter(cfg, expert=True).shards}"
                      if cfg.model.num_moe_experts is not None else "") + "), "
                   f"total={per.total:.4g}; per rank: weight={footprint.weight_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB, "
                   f"gradient={footprint.gradient_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB, "
                   f"optimizer={footprint.optimizer_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB")
        per_layer = activation_memory_per_layer(cfg, recompute=cfg.model.recompute_granularity == "selective")
        write_line(f"Theoretical activation memory per layer and micro-batch: "
                   f"{per_layer / NUM_BYTES_IN_MEGABYTE:.2f} MB")
    weight_and_optimizer = footprint.weight_and_optimizer_bytes / NUM_BYTES_IN_MEGABYTE
    activation = footprint.activation_bytes / NUM_BYTES_IN_MEGABYTE
    write_line(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB, "
               f"activation={activation:.2f} MB, total={weight_and_optimizer + activation:.2f} MB\n")
    return footprint


# ---------------------------------------------------------------------------------------------------
# Will the model fit at all? (a shape read from a checkpoint's saved args)
# ---------------------------------------------------------------------------------------------------

def available_host_memory() -> Optional[int]:
    """Bytes of memory this host can still give: ``MemAvailable`` of /proc/meminfo, else the free
    physical pages (``os.sysconf``); None when neither is known."""
    import os

    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def model_memory_refusal(config, source: str, local_ranks: int = 1, device_memory: Optional[int] = None,
                         host_memory: Optional[int] = None) -> Optional[str]:
    """Why the model ``config`` (or a checkpoint's validated args) describes cannot be built here, or None
    when its parameters fit.

    The decision for every tool that takes the model's shape from a checkpoint (``source`` names the
    file): the parameters of one rank (:func:`num_parameters_in_model` over TP x PP, at 2 bytes for
    bf16/fp16 and 4 for fp32) times the ``local_ranks`` this host runs must fit in ``host_memory``
    (default :func:`available_host_memory`), or, on a GPU, one rank's in ``device_memory`` (bytes of
    that GPU; None without one). Only the parameters count, so a refusal is certain, not a guess about
    activations. Args must be validated (``kv_channels``, ``ffn_hidden_size`` and
    ``padded_vocab_size`` set).
    """
    cfg = as_config(config)
    model = cfg.model
    total = num_parameters_in_model(cfg)
    ranks_per_model = max(1, model.tensor_model_parallel_size) * max(1, model.pipeline_model_parallel_size)
    element = 2 if (model.fp16 or model.bf16) else 4
    per_rank = -(-total // ranks_per_model) * element
    if model.num_moe_experts is not None:  # the experts are split over ETP x EP (x PP), the rest over TP x PP
        experts = _num_routed_expert_parameters(model)
        expert_ranks = (model.expert_tensor_parallel_size * model.expert_model_parallel_size
                        * max(1, model.pipeline_model_parallel_size))
        per_rank = (-(-(total - experts) // ranks_per_model) + -(-experts // expert_ranks)) * element
    shape = (f"{total:,} parameters (--num-layers {model.num_layers}, --hidden-size {model.hidden_size}, "
             f"--ffn-hidden-size {model.ffn_hidden_size}, vocabulary {cfg.tokenizer.padded_vocab_size})")
    if device_memory is not None:  # the parameters live on the GPU
        if per_rank > device_memory:
            return (f"{source} describes a model of {shape}: {per_rank / 2**30:,.1f} GiB per rank, more than the "
                    f"{device_memory / 2**30:,.1f} GiB of this GPU; refusing to build it")
        return None
    host_memory = available_host_memory() if host_memory is None else host_memory
    if host_memory is not None and per_rank * local_ranks > host_memory:
        return (f"{source} describes a model of {shape}: {per_rank * local_ranks / 2**30:,.1f} GiB for the "
                f"{local_ranks} rank(s) of this host, more than its {host_memory / 2**30:,.1f} GiB of available "
                "memory; refusing to build it")
    return None
