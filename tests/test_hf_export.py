"""tools/checkpoint/export_hf.py and import_hf.py: tiny GPT-2-style and Llama-style models trained by
pretrain_gpt.py at TP=1 and TP=2 give, once exported, the same logits in `transformers` (fp32, 1e-4)
as this project's model at the checkpoint's TP; export -> import gives back the same weights."""
import json
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import load_checkpoint_tool, run_pretrain, run_python, run_ranks
from tokenizer_files import build_hf_bpe_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURES = ("gpt2", "llama")
TP_SIZES = (1, 2)
BATCH, SEQ = 2, 24


_load_tool = load_checkpoint_tool


legacy = _load_tool("legacy_checkpoint")
export_hf = _load_tool("export_hf")
import_hf = _load_tool("import_hf")


def _preprocess(shared_data, out_prefix, tokenizer_flags):
    """The first 400 Shakespeare documents through tools/preprocess_data.py; returns the dataset prefix."""
    source = Path(f"{out_prefix}.jsonl")
    with open(shared_data / "tinyshakespeare.jsonl", encoding="utf-8") as stream:
        source.write_text("".join(line for _, line in zip(range(400), stream)), encoding="utf-8")
    run_python(["tools/preprocess_data.py", "--input", str(source), "--output-prefix", str(out_prefix),
                *tokenizer_flags, "--append-eod", "--workers", "1", "--log-interval", "100000"])
    return f"{out_prefix}_text_document"


def _model_flags(arch, hf_dir):
    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--micro-batch-size", "4", "--train-iters", "2", "--eval-iters",
              "0", "--save-interval", "2", "--lr", "1e-2", "--lr-warmup-iters", "1", "--use-cpu-initialization"]
    if arch == "gpt2":
        return common
    return [*common, "--position-embedding-type", "rope", "--rotary-base", "5000", "--normalization", "RMSNorm",
            "--swiglu", "--ffn-hidden-size", "48", "--group-query-attention", "--num-query-groups", "2",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--norm-epsilon", "1e-6",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]


@pytest.fixture(scope="module")
def trained(shared_data, shakespeare_prefix, tmp_path_factory):
    """{(arch, tp): checkpoint dir}: each architecture trained 2 iterations at TP=1 and TP=2."""
    root = tmp_path_factory.mktemp("hf_export")
    hf_tok = build_hf_bpe_tokenizer(root / "hf_tokenizer", shared_data)
    llama_data = _preprocess(shared_data, root / "shakes_hf",
                             ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_tok)])
    checkpoints = {}
    for arch in ARCHITECTURES:
        for tp in TP_SIZES:
            save = root / f"{arch}_tp{tp}"
            data = shakespeare_prefix if arch == "gpt2" else llama_data
            run_pretrain(tp, [*_model_flags(arch, hf_tok), "--tensor-model-parallel-size", str(tp),
                              "--save", str(save), "--ckpt-format", "torch"], shared_data, data, root / f"run_{arch}_{tp}")
            checkpoints[(arch, tp)] = save
    return checkpoints


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """{(arch, tp): HF folder} written by export_hf.py from each checkpoint."""
    root = tmp_path_factory.mktemp("hf_models")
    folders = {}
    for (arch, tp), checkpoint in trained.items():
        folders[(arch, tp)] = root / f"{arch}_tp{tp}"
        assert export_hf.main(["--load", str(checkpoint), "--save", str(folders[(arch, tp)])]) == 0
    return folders


def _batch(vocab_size):
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)


def _project_logits(rank, world, checkpoints, vocab_sizes):
    """Logits [b, s, V_pad] of this project's GPTModel at each checkpoint's own TP (fp32, eval)."""
    import argparse

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.checkpointing import load_state_dict_file

    results = {}
    for key, path in checkpoints.items():
        tp = key[1]
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        iteration_dir = legacy.find_iteration_dir(str(path))
        shard = load_state_dict_file(f"{iteration_dir}/mp_rank_{ps.get_tensor_model_parallel_rank():02d}/"
                                     "model_optim_rng.pt")
        args = argparse.Namespace(**vars(shard["args"]))
        args.hidden_dropout = args.attention_dropout = 0.0
        model = GPTModel(core_transformer_config_from_args(args), vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings, parallel_output=False,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base)
        model.load_state_dict(shard["model"])
        model.eval()
        tokens = _batch(vocab_sizes[key[0]])
        with torch.no_grad():
            logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
        if rank == 0:
            results[key] = logits
    return results


VOCAB_SIZES = {"gpt2": 50257, "llama": 500}


# The first test also pays for the module fixtures: four short trainings (two of them on two ranks).
@pytest.mark.timeout(1500)
def test_exported_logits_equal_the_project_models(trained, exported):
    """The HF model's logits equal this project's GPTModel at the checkpoint's own TP (padded rows aside)."""
    reference = run_distributed(_project_logits, 2, {k: str(v) for k, v in trained.items()}, VOCAB_SIZES,
                                timeout=500)[0]
    for (arch, tp), folder in exported.items():
        vocab = VOCAB_SIZES[arch]
        config = transformers.AutoConfig.from_pretrained(folder)
        assert config.model_type == arch and config.vocab_size == vocab
        assert config.tie_word_embeddings == (arch == "gpt2")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            hf_logits = model(_batch(vocab)).logits
        ours = reference[(arch, tp)]
        assert ours.shape[-1] > vocab  # the padded rows are not exported
        torch.testing.assert_close(hf_logits, ours[..., :vocab], atol=1e-4, rtol=0,
                                   msg=lambda m: f"{arch} TP={tp}: {m}")
        # The tokenizer files give the ids of the tokenizer the model was trained with.
        text = "Hello world, it's me"
        hf_ids = transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
        if arch == "gpt2":
            assert hf_ids == [15496, 995, 11, 340, 338, 502]
        else:
            trained_with = transformers.AutoTokenizer.from_pretrained(trained[(arch, tp)].parent / "hf_tokenizer")
            assert hf_ids == trained_with(text)["input_ids"] and hf_ids[0] == trained_with.bos_token_id


@pytest.mark.timeout(300)
def test_export_then_import_gives_back_the_checkpoint(trained, exported, tmp_path):
    for (arch, tp), folder in exported.items():
        vocab = VOCAB_SIZES[arch]
        back = tmp_path / f"back_{arch}_tp{tp}"
        assert import_hf.main(["--load", str(folder), "--save", str(back), "--target-tensor-parallel-size",
                               str(tp)]) == 0
        original, original_args, info = legacy.read_checkpoint(str(trained[(arch, tp)]))
        imported, imported_args, imported_info = legacy.read_checkpoint(str(back))
        assert (info["tp"], imported_info["tp"]) == (tp, tp)
        assert imported_args.padded_vocab_size == original_args.padded_vocab_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "swiglu",
                     "position_embedding_type", "normalization", "untie_embeddings_and_output_weights",
                     "add_bias_linear", "max_position_embeddings"):
            assert getattr(imported_args, name) == getattr(original_args, name), name
        assert sorted(imported) == sorted(original)
        for name, value in original.items():
            if value is None:
                assert imported[name] is None, name
            elif name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                assert torch.equal(imported[name][:vocab], value[:vocab]), name
                assert not imported[name][vocab:].any(), name  # padded rows are not exported: zeros
            else:
                assert torch.equal(imported[name], value), f"{arch} TP={tp}: {name}"


@pytest.mark.timeout(600)
def test_greedy_generation_equals_transformers_generate(trained, exported, tmp_path):
    """run_text_generation.py --greedy on the checkpoint == transformers' generate() on the export."""
    for arch, tp in (("gpt2", 1), ("llama", 2)):
        output = tmp_path / f"generated_{arch}.json"
        result = run_ranks(  # torchrun's environment, the ranks forked from the fork server
            tp, ["tools/run_text_generation.py", "--load", str(trained[(arch, tp)]),
                 "--use-checkpoint-args", "--tensor-model-parallel-size", str(tp), "--prompt", "ROMEO: To be, or",
                 "--greedy", "--max-new-tokens", "12", "--output-file", str(output)], timeout=400)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        ours = json.loads(output.read_text())
        tokenizer = transformers.AutoTokenizer.from_pretrained(exported[(arch, tp)])
        assert tokenizer("ROMEO: To be, or")["input_ids"] == ours["prompt_ids"]
        model = transformers.AutoModelForCausalLM.from_pretrained(exported[(arch, tp)], dtype=torch.float32)
        model.eval()
        prompt = torch.tensor([ours["prompt_ids"]])
        with torch.no_grad():
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                       max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
        assert generated[0, prompt.size(1):].tolist() == ours["generated_ids"], arch
        assert len(ours["generated_ids"]) > 0
