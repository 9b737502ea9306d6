"""tools/run_text_generation.py and megatron.core.inference.sampling: greedy generation at TP=1 equals TP=2 and a
step-by-step argmax of the model's own forward; top-k / top-p / temperature keep the right tokens."""
import json
import os

import pytest
import torch

from megatron.core.inference.sampling import sample_logits
from pretrain_utils import run_ranks

PROMPT = "To be, or not to be"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--init-method-std", "0.3", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


# --------------------------------------------------------------------------------------------------
# sample_logits
# --------------------------------------------------------------------------------------------------

def test_greedy_takes_argmax_and_never_a_padding_id():
    logits = torch.tensor([[0.1, 2.0, 0.3, 9.0], [5.0, 1.0, 4.0, 0.0]])
    assert sample_logits(logits, greedy=True).tolist() == [3, 0]
    # id 3 is a padding row of the embedding (vocab_size 3): never chosen, even when it scores best
    assert sample_logits(logits, greedy=True, vocab_size=3).tolist() == [1, 0]


def test_top_k_samples_only_the_k_best():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3.0, 2.9, 0.0, 2.8, -1.0, 1.0]]).repeat(500, 1)
    drawn = set(sample_logits(logits, top_k=3, generator=generator).tolist())
    assert drawn == {0, 1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(2000, 1)
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: ids 0 and 1 are kept, in the ratio 5:3
    drawn = sample_logits(logits, top_p=0.7, generator=generator)
    assert set(drawn.tolist()) == {0, 1}
    share = (drawn == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.05, share
    # exactly reaching p on the first id keeps only that id
    assert set(sample_logits(logits, top_p=0.5, generator=generator).tolist()) == {0}


def test_sampling_follows_softmax_and_temperature():
    generator = torch.Generator().manual_seed(1)
    logits = torch.tensor([[1.0, 0.0, -1.0]]).repeat(20000, 1)
    for temperature in (1.0, 0.5, 2.0):
        drawn = sample_logits(logits, temperature=temperature, generator=generator)
        frequencies = torch.bincount(drawn, minlength=3).float() / drawn.numel()
        expected = torch.softmax(logits[0] / temperature, dim=0)
        assert torch.allclose(frequencies, expected, atol=0.015), (temperature, frequencies, expected)


def test_bad_sampling_options_are_named():
    logits = torch.zeros(1, 4)
    for kwargs, word in (({"temperature": 0.0}, "temperature"), ({"top_k": -1}, "top_k"),
                         ({"top_p": 1.5}, "top_p"), ({"vocab_size": 5}, "vocab_size")):
        with pytest.raises(ValueError, match=word):
            sample_logits(logits, **kwargs)
    with pytest.raises(ValueError, match=r"\[b, V\]"):
        sample_logits(torch.zeros(4))


# --------------------------------------------------------------------------------------------------
# tools/run_text_generation.py on checkpoints written by pretrain_gpt.py
# --------------------------------------------------------------------------------------------------

def _torchrun(nproc, argv, timeout=240):
    """Run ``argv`` on ``nproc`` ranks (pretrain_utils.run_ranks: torchrun's environment, forked ranks)."""
    result = run_ranks(nproc, argv, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _tokenizer_flags(shared_data):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(shared_data / "gpt2-vocab.json"),
            "--merge-file", str(shared_data / "gpt2-merges.txt")]


@pytest.fixture(scope="module")
def checkpoints(shared_data, tmp_path_factory):
    """{tp: checkpoint dir}: the same tiny GPT trained 3 iterations on mock data at TP=1 and TP=2."""
    out = tmp_path_factory.mktemp("textgen")
    saved = {}
    for tp in (1, 2):
        saved[tp] = out / f"ckpt_tp{tp}"
        # 256 x TP keeps the padded vocabulary (50432) the same at both sizes
        _torchrun(tp, ["pretrain_gpt.py", *MODEL, "--micro-batch-size", "2", "--global-batch-size", "2",
                       "--lr", "1e-3", "--train-iters", "3", "--mock-data", "--eval-iters", "0",
                       "--tensor-model-parallel-size", str(tp), "--make-vocab-size-divisible-by", str(256 // tp),
                       "--save", str(saved[tp]), "--save-interval", "3", "--ckpt-format", "torch", "--data-cache-path", str(out / "cache"),
                       *_tokenizer_flags(shared_data)])
    return saved


def _generate(tp, load, tmp_path, *flags):
    output = tmp_path / f"generated_tp{tp}.json"
    stdout = _torchrun(tp, ["tools/run_text_generation.py", "--load", str(load), "--use-checkpoint-args",
                            "--prompt", PROMPT, "--output-file", str(output), *flags])
    result = json.loads(output.read_text())
    assert stdout.split("===== generated =====\n")[1].startswith(PROMPT + result["text"])
    return result


def _reference_greedy(checkpoint_dir, prompt_ids, steps, vocab_size):
    """Argmax continuation with the TP=1 checkpoint's weights in a GPTModel built here, one forward per token."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron.training.checkpointing import load_state_dict_file

    state = load_state_dict_file(str(checkpoint_dir / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"))
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    model = GPTModel(config, vocab_size=state["args"].padded_vocab_size, max_sequence_length=32,
                     share_embeddings_and_output_weights=True)
    model.load_state_dict(state["model"])
    model.eval()
    tokens = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(len(tokens)).unsqueeze(0), None)  # [1, s, V_pad]
            tokens.append(int(torch.argmax(logits[0, -1, :vocab_size])))
    return tokens[len(prompt_ids):]


@pytest.mark.timeout(600)
def test_generation_is_the_same_at_tp1_and_tp2_and_greedy_equals_stepwise_argmax(checkpoints, tmp_path):
    greedy = ["--greedy", "--max-new-tokens", "10", "--ignore-eod"]
    tp1 = _generate(1, checkpoints[1], tmp_path, *greedy)
    tp2 = _generate(2, checkpoints[2], tmp_path, *greedy)
    assert tp1["prompt_ids"] == [2514, 307, 11, 393, 407, 284, 307]  # GPT-2 BPE of the prompt
    assert len(tp1["generated_ids"]) == 10
    assert tp1["generated_ids"] == tp2["generated_ids"]
    assert tp1["generated_ids"] == _reference_greedy(checkpoints[1], tp1["prompt_ids"], 10, 50257)
    assert len(set(tp1["generated_ids"])) > 1, "a degenerate continuation would prove little"

    # TP rank 0's draw is broadcast, so both TP layouts follow one random stream from --seed
    sampled = ["--top-k", "50", "--top-p", "0.95", "--temperature", "1.5", "--max-new-tokens", "10",
               "--ignore-eod", "--seed", "7"]
    sampled_tp1 = _generate(1, checkpoints[1], tmp_path, *sampled)
    sampled_tp2 = _generate(2, checkpoints[2], tmp_path, *sampled)
    assert sampled_tp1["generated_ids"] == sampled_tp2["generated_ids"]
    assert sampled_tp1["generated_ids"] != tp1["generated_ids"], "sampling at temperature 1.5 drew the argmax"


@pytest.mark.timeout(300)
def test_generation_is_one_inference_span_with_genai_attributes(checkpoints, tmp_path):
    """With telemetry on and nothing else set, the default span groups include ``inference``: the request
    is one ``text_completion gpt`` span (Megatron-LM's name and GenAI attributes), and the prompt is not in it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_EXPORTER="console", MEGATRON_OTEL_METRICS_ENABLED="0")
    result = run_ranks(1, ["tools/run_text_generation.py", "--load", str(checkpoints[1]), "--use-checkpoint-args",
                           "--prompt", PROMPT, "--max-new-tokens", "4", "--ignore-eod", "--top-k", "5",
                           "--temperature", "0.5", "--seed", "3"], env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    spans = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"name":')]
    (span,) = [s for s in spans if s["name"] == "text_completion gpt"]
    attrs = span["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.provider.name"] == "megatron"
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.top_k"], attrs["gen_ai.request.seed"]) == (4, 5, 3)
    assert attrs["gen_ai.request.temperature"] == 0.5 and "gen_ai.request.top_p" not in attrs
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (7, 4)
    assert PROMPT not in json.dumps(span)


def test_continuation_keeps_the_space_a_sentencepiece_word_starts_with(shared_data):
    from megatron.core.tokenizers.null_tokenizer import NullTokenizer
    from megatron.core.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
    import importlib.util

    from pretrain_utils import REPO

    spec = importlib.util.spec_from_file_location("_tool_run_text_generation", REPO / "tools" / "run_text_generation.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    continuation_text = tool.continuation_text
    tokenizer = SentencePieceTokenizer(str(shared_data / "shakespeare-sp8k.model"))
    prompt, whole = "ROMEO: I will", "ROMEO: I will not go to the king"
    prompt_ids, whole_ids = tokenizer.tokenize(prompt), tokenizer.tokenize(whole)
    assert whole_ids[:len(prompt_ids)] == prompt_ids
    assert prompt + tokenizer.detokenize(whole_ids[len(prompt_ids):]) != whole  # decoded alone: "willnot"
    assert prompt + continuation_text(tokenizer, prompt_ids, whole_ids[len(prompt_ids):]) == whole
    null = NullTokenizer(100)
    assert "1 2" + continuation_text(null, [1, 2], [3, 4]) == "1 2 3 4"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", ["mixtral", "shared"])
def test_use_checkpoint_args_builds_the_moe_model_of_megatrons_moe_checkpoint(variant, tmp_path):
    """--use-checkpoint-args copies the MoE shape (--num-experts, --moe-layer-freq, shared expert, ...): the
    megatron-core 0.14.0-written MoE fixture loads strictly, and the first greedy token is the argmax of the
    logits megatron-core computed for the prompt (NullTokenizer: the prompt is the ids)."""
    fixture = os.path.join(os.path.dirname(__file__), "data", "mcore_v014", "moe", variant)
    reference = torch.load(os.path.join(fixture, "reference.pt"), weights_only=True)
    prompt_ids = reference["input_ids"][0, :6].tolist()
    output = tmp_path / "generated.json"
    _torchrun(1, ["tools/run_text_generation.py", "--load", os.path.join(fixture, "torch_dist"),
                  "--use-checkpoint-args", "--prompt", " ".join(map(str, prompt_ids)), "--greedy",
                  "--max-new-tokens", "1", "--ignore-eod", "--output-file", str(output)])
    result = json.loads(output.read_text())
    assert result["prompt_ids"] == prompt_ids
    assert result["generated_ids"] == [int(torch.argmax(reference["logits"][0, len(prompt_ids) - 1, :100]))]
