"""Generate text from a checkpoint written by pretrain_gpt.py: greedy, top-k, top-p and temperature sampling, at any TP.

One process per tensor-parallel rank, as in training (``--tensor-model-parallel-size`` must equal the
checkpoint's; data-parallel replicas, if any, all generate the same text). The model flags are the
training flags, or ``--use-checkpoint-args`` reads them from the checkpoint::

    torchrun --standalone --nproc_per_node 1 tools/run_text_generation.py --load runs/ckpt \\
        --use-checkpoint-args --prompt "ROMEO:" --max-new-tokens 40 --greedy
    torchrun --standalone --nproc_per_node 2 tools/run_text_generation.py --load runs/ckpt_tp2 \\
        --use-checkpoint-args --tensor-model-parallel-size 2 --prompt "ROMEO:" --top-p 0.9 --temperature 0.8

The prompt is tokenized with the training tokenizer flags (no EOD is added). Generation recomputes the
whole sequence each step (no KV cache: simple, and fast enough for the short samples this tool is for),
stops after ``--max-new-tokens``, at the model's ``--max-position-embeddings`` (else ``--seq-length``) tokens,
or at the tokenizer's end-of-document id (unless ``--ignore-eod``). Rank 0 prints the text after a line
``===== generated =====`` and, with ``--output-file``, writes a JSON object
``{"prompt", "prompt_ids", "generated_ids", "text"}`` (``text`` is the detokenized continuation only).
With telemetry on (``MEGATRON_OTEL_ENABLED=1``) the generation is one ``text_completion gpt`` span of the
``inference`` group (in the default groups), with the OpenTelemetry GenAI request and token-count attributes.
"""
import argparse
import json
import os
import sys
from typing import Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.collective_device import get_collective_device  # noqa: E402
from megatron.core.console import write_line  # noqa: E402
from megatron.core.inference.sampling import sample_logits  # noqa: E402
from megatron.core.telemetry import managed_span, safe_set_span_attributes  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.checkpointing import (  # noqa: E402
    MODEL_SHAPE_ARGS,
    get_checkpoint_tracker_filename,
    layout,
    load_checkpoint,
    load_state_dict_file,
    read_metadata,
    saved_args,
)
from megatron.training.checkpointing.errors import checkpoint_errors_as_user_errors  # noqa: E402
from megatron.training.checkpointing.tracker import tracker_exists  # noqa: E402
from megatron.training.global_vars import get_tokenizer  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.theoretical_memory_usage import model_memory_refusal  # noqa: E402
from megatron.training.training import get_model  # noqa: E402
from megatron.training.user_errors import UserInputError, run_reporting_user_errors  # noqa: E402
from megatron.training.utils import get_device  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402

# What --use-checkpoint-args copies from the checkpoint: the model's shape and the tokenizer (Megatron's list,
# restricted to the flags this framework has).
CHECKPOINT_MODEL_ARGS = [
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "group_query_attention",
    "num_query_groups", "seq_length", "max_position_embeddings", "position_embedding_type", "rotary_percent",
    "rotary_base", "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
    "normalization", "norm_epsilon", "apply_layernorm_1p", "swiglu", "squared_relu", "openai_gelu",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
    "make_vocab_size_divisible_by", "padded_vocab_size", "vocab_size", "tokenizer_type", "vocab_file",
    "merge_file", "tokenizer_model", "vocab_extra_ids", "null_tokenizer_eod_id", "null_tokenizer_pad_id",
    "tensor_model_parallel_size", "fp16", "bf16", "apply_residual_connection_post_layernorm",
    # MoE: Megatron's list, plus the router settings that change the function (score, scaling, groups, bias).
    "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
    "moe_grouped_gemm", "moe_shared_expert_intermediate_size", "moe_router_score_function",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_router_dtype",
]

# Tokenizer files named on the command line win over the checkpoint's saved paths.
_USER_TOKENIZER_FILES = ("tokenizer_model", "vocab_file", "merge_file")


def add_text_generation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The "text generation" flag group; returns ``parser``."""
    group = parser.add_argument_group(title="text generation")
    group.add_argument("--prompt", type=str, required=True, help="Text to continue (tokenized without an EOD).")
    group.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate at most.")
    group.add_argument("--greedy", action="store_true", help="Take the most likely token at every step.")
    group.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    group.add_argument("--top-p", type=float, default=0.0,
                       help="Sample among the most likely tokens whose probability sums to p (0: all).")
    group.add_argument("--temperature", type=float, default=1.0, help="Divide the logits by this before sampling.")
    group.add_argument("--ignore-eod", action="store_true", help="Keep generating after the end-of-document token.")
    group.add_argument("--use-checkpoint-args", action="store_true",
                       help="Take the model and tokenizer flags from the checkpoint in --load.")
    group.add_argument("--output-file", type=str, default=None,
                       help="Rank 0 writes {prompt, prompt_ids, generated_ids, text} here as JSON.")
    return parser


# Sizes among CHECKPOINT_MODEL_ARGS: positive integers when the checkpoint has them.
_SIZE_ARGS = ("ffn_hidden_size", "kv_channels", "num_query_groups", "seq_length", "max_position_embeddings",
              "padded_vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size")


def _checkpoint_args(load_dir: str) -> Tuple[argparse.Namespace, str]:
    """The training args saved in the newest checkpoint of ``load_dir`` (its first rank file) and that file.

    Raises UserInputError naming --load when there is no tracker or no rank file; the errors of
    read_metadata, load_state_dict_file and saved_args (a malformed tracker, an unsafe or damaged file,
    args that are not a Namespace or whose sizes are not positive integers).
    """
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not tracker_exists(tracker):  # CheckpointTrackerError for a FIFO, a device...
        raise UserInputError(f"--load {load_dir}: no checkpoint there (missing {tracker})")
    iteration, release = read_metadata(tracker)
    folder = layout.iteration_dirname(iteration, release)
    iteration_dir = os.path.join(load_dir, folder)
    # torch_dist: the common state holds the args; torch (legacy): every rank file does.
    ckpt_format = layout.detect_format(iteration_dir) if os.path.isdir(iteration_dir) else None
    if ckpt_format == "torch_dist":
        files = [layout.common_file_name(iteration_dir)]
    elif ckpt_format == "torch":
        files = [os.path.join(iteration_dir, entry, layout.CHECKPOINT_BASENAME)
                 for entry in layout.rank_dirnames(iteration_dir)]
    else:
        files = []
    files = [name for name in files if os.path.lexists(name)]  # as a glob finds them
    if not files:
        raise UserInputError(f"--load {load_dir}: neither {layout.COMMON_BASENAME} (torch_dist) nor "
                             f"{layout.RANK_DIR_PREFIX}*/{layout.CHECKPOINT_BASENAME} (torch) under {folder}")
    saved = saved_args(load_state_dict_file(files[0], f"--load {load_dir}"), files[0], f"--load {load_dir}",
                       required=MODEL_SHAPE_ARGS, positive_if_set=_SIZE_ARGS)
    if saved is None:
        raise UserInputError(f"--use-checkpoint-args: {files[0]} holds no training args; give the model flags")
    return saved, files[0]


def parse_generation_args(argv=None) -> argparse.Namespace:
    """Training + generation flags; with ``--use-checkpoint-args`` the model/tokenizer flags come from ``--load``."""
    args = parse_args(add_text_generation_args, args=argv)
    if args.load is None:
        raise UserInputError("--load is required: the checkpoint directory written by pretrain_gpt.py --save")
    if args.use_checkpoint_args:
        with checkpoint_errors_as_user_errors():
            saved, args.checkpoint_args_file = _checkpoint_args(args.load)
        given_tokenizer_model = args.tokenizer_model
        for name in CHECKPOINT_MODEL_ARGS:
            if hasattr(saved, name) and not (name in _USER_TOKENIZER_FILES and getattr(args, name) is not None):
                setattr(args, name, getattr(saved, name))
        if args.trust_remote_code and args.tokenizer_type == "HuggingFaceTokenizer" and given_tokenizer_model is None:
            # The checkpoint would choose the folder whose Python files --trust-remote-code lets run.
            raise UserInputError("--trust-remote-code with --use-checkpoint-args needs --tokenizer-model: the "
                                 f"checkpoint's saved tokenizer path ({args.tokenizer_model}) is not trusted to "
                                 "choose code to run")
    # The sequence grows one token at a time, so it cannot be split across TP ranks (SP needs s % TP == 0);
    # without SP the model computes the same function.
    args.sequence_parallel = False
    # Generation trains nothing: these only satisfy the training-flag validation.
    args.skip_train = True
    if args.train_iters is None and args.train_samples is None:
        args.train_iters = 1
    if args.micro_batch_size is None:
        args.micro_batch_size = 1
    args.no_load_optim, args.no_load_rng, args.exit_on_missing_checkpoint = True, True, True
    args.auto_detect_ckpt_format = True  # a reader: either format loads
    return args


def continuation_text(tokenizer, prompt_ids, generated_ids) -> str:
    """The text ``generated_ids`` add after ``prompt_ids``, decoded together with them: SentencePiece and
    other tokenizers drop a word's leading space when a continuation is decoded alone ("statement" +
    "is" instead of "statement" + " is")."""
    prompt_text = tokenizer.detokenize(prompt_ids)
    whole = tokenizer.detokenize(list(prompt_ids) + list(generated_ids))
    if whole.startswith(prompt_text):
        return whole[len(prompt_text):]
    return tokenizer.detokenize(generated_ids)  # the ids merge across the boundary: nothing better to split


def _broadcast_from_tp_src(tokens: torch.Tensor) -> torch.Tensor:
    """TP rank 0's ``tokens`` on every rank of its TP group (sampled draws must agree across the shards)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tokens
    group = parallel_state.get_tensor_model_parallel_group()
    buffer = tokens.to(get_collective_device(group))
    dist.broadcast(buffer, src=parallel_state.get_tensor_model_parallel_src_rank(), group=group)
    return buffer.to(tokens.device)


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens, max_length, eod=None, greedy=False, top_k=0, top_p=0.0,
             temperature=1.0, vocab_size=None, generator=None):
    """Continue ``prompt_ids`` (a list of ints) with ``model``; returns the generated ids (a list).

    Each step runs the model on the whole sequence ``[1, s]`` (positions ``0..s-1``, causal mask), gathers
    the vocabulary-parallel logits of the last position ``[1, V_pad]`` and picks the next id with
    ``megatron.core.inference.sampling.sample_logits``; TP rank 0's choice is used on every TP rank.
    Stops after ``max_new_tokens``, when the sequence reaches ``max_length``, or after ``eod`` (kept in the
    output) when it is not None. Raises ValueError for an empty prompt or one of ``max_length`` tokens or more.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty after tokenization")
    if len(prompt_ids) >= max_length:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens: no room to generate below the model's "
                         f"{max_length}-token limit (--max-position-embeddings, else --seq-length)")
    device = get_device()
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generated = []
    for _ in range(min(max_new_tokens, max_length - len(prompt_ids))):
        position_ids = torch.arange(tokens.size(1), device=device).unsqueeze(0)
        logits = model(tokens, position_ids, None, runtime_gather_output=True)  # [1, s, V_pad]
        next_id = sample_logits(logits[:, -1, :], greedy=greedy, top_k=top_k, top_p=top_p,
                                temperature=temperature, vocab_size=vocab_size, generator=generator)
        next_id = _broadcast_from_tp_src(next_id)
        generated.append(int(next_id.item()))
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
        if eod is not None and generated[-1] == eod:
            break
    return generated


def generation_span_attributes(args, prompt_tokens: int) -> dict:
    """The ``text_completion gpt`` span's attributes (OpenTelemetry GenAI semantic conventions, as
    Megatron-LM's server sets them): operation, provider, model, the sampling request and the prompt's
    token count; ``top_k``/``top_p`` only when they restrict sampling (greedy: ``temperature`` omitted)."""
    attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "megatron",
             "gen_ai.request.model": "gpt", "gen_ai.request.max_tokens": int(args.max_new_tokens),
             "gen_ai.request.seed": int(args.seed), "gen_ai.usage.input_tokens": int(prompt_tokens)}
    if not args.greedy:
        attrs["gen_ai.request.temperature"] = float(args.temperature)
        if args.top_k > 0:
            attrs["gen_ai.request.top_k"] = int(args.top_k)
        if args.top_p > 0.0:
            attrs["gen_ai.request.top_p"] = float(args.top_p)
    return attrs


def main(argv=None) -> None:
    """Parse the flags, load the checkpoint and generate; rank 0 prints (and writes) the result."""
    args = parse_generation_args(argv)
    for value, flag in ((args.temperature > 0, "--temperature must be > 0"),
                        (args.top_k >= 0, "--top-k must be >= 0"),
                        (0.0 <= args.top_p <= 1.0, "--top-p must be in [0, 1]"),
                        (args.max_new_tokens > 0, "--max-new-tokens must be > 0")):
        if not value:
            raise UserInputError(flag, exit_status=2, same_on_every_rank=True)
    initialize_megatron(parsed_args=args)
    if args.use_checkpoint_args:  # a checkpoint's args chose the shape: refuse one this host cannot hold
        device = get_device()
        refusal = model_memory_refusal(
            args, f"--use-checkpoint-args: {args.checkpoint_args_file}",
            local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            device_memory=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
        if refusal is not None:
            raise UserInputError(refusal, same_on_every_rank=True)
    model = get_model(model_provider, wrap_with_ddp=False)
    with checkpoint_errors_as_user_errors():
        load_checkpoint(model, None, None, strict=True)
    model = model[0]
    model.eval()

    tokenizer = get_tokenizer()
    prompt_ids = list(tokenizer.tokenize(args.prompt))
    generator = torch.Generator(device=get_device())
    generator.manual_seed(args.seed)
    max_length = args.max_position_embeddings or args.seq_length
    # One span per request in the ``inference`` group (on by default when telemetry is on), named and
    # attributed as Megatron-LM's text-generation server does (OpenTelemetry GenAI conventions). The
    # prompt and the text are not attributes: they are user content.
    with managed_span("inference", "text_completion gpt", **generation_span_attributes(args, len(prompt_ids))) as span:
        try:
            generated = generate(model, prompt_ids, args.max_new_tokens, max_length,
                                 eod=None if args.ignore_eod else getattr(tokenizer, "eod", None),
                                 greedy=args.greedy, top_k=args.top_k, top_p=args.top_p, temperature=args.temperature,
                                 vocab_size=tokenizer.vocab_size, generator=generator)
        except ValueError as error:
            raise UserInputError(f"--prompt: {error}", same_on_every_rank=True) from error
        safe_set_span_attributes(span, {"gen_ai.usage.output_tokens": len(generated)})

    if args.rank == 0:
        text = continuation_text(tokenizer, prompt_ids, generated)
        write_line("===== generated =====")
        write_line(args.prompt + text)
        if args.output_file:
            with open(args.output_file, "w", encoding="utf-8") as out:
                json.dump({"prompt": args.prompt, "prompt_ids": prompt_ids, "generated_ids": generated,
                           "text": text}, out)
                out.write("\n")


if __name__ == "__main__":
    run_reporting_user_errors(main)
