"""torch.compile readiness: 0 graph breaks in a GPTModel forward, and per-layer compile equal to eager."""
import os

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core import telemetry as tel
from megatron.core.models.gpt import GPTModel
from megatron.core.telemetry import state as tel_state
from megatron.core.transformer import TransformerConfig
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

H, HEADS, V, S, B = 16, 4, 32, 8, 2


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_telemetry():
    torch._dynamo.reset()
    yield
    handle = tel_state.live_handle()
    if handle is not None:
        handle.shutdown(timeout_ms=2000)
    tel_state.deactivate()
    torch._dynamo.reset()


def _model(num_layers, seed=0, **kw):
    cfg = dict(num_layers=num_layers, hidden_size=H, num_attention_heads=HEADS, hidden_dropout=0.0,
               attention_dropout=0.0, use_cpu_initialization=True)
    cfg.update(kw)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return GPTModel(TransformerConfig(**cfg), vocab_size=V, max_sequence_length=S)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S), torch.randint(0, V, (B, S), generator=g)


def _loss_and_grads(run, model=None):
    ids, pos, labels = _batch()
    loss = run(ids, pos, None, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in (model or run).named_parameters()}


def _layer_group_on_rank_not_exporting():
    # single_rank exports on the last rank only: rank 0 of 2 keeps the `layer` group configured
    # but does not export, so every managed_span takes the disabled path.
    config = tel.TelemetryConfig(enabled=True, span_groups="layer", run_id="compile-test")
    handle = tel.setup_telemetry(config, rank=0, world_size=2)
    assert handle.enabled and not handle.is_exporting and not tel.is_span_group_enabled("layer")
    return handle


def _break_summary(explanation):
    return [(b.reason.splitlines()[0], [f"{f.filename}:{f.lineno}" for f in b.user_stack[-2:]])
            for b in explanation.break_reasons]


@pytest.mark.parametrize("telemetry", ["off", "layer_group_not_exporting"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_gpt_forward_has_no_graph_breaks(num_layers, telemetry):
    if telemetry != "off":
        _layer_group_on_rank_not_exporting()
    model = _model(num_layers)
    ids, pos, labels = _batch()
    explanation = torch._dynamo.explain(model)(ids, pos, None, labels=labels)
    assert explanation.graph_break_count == 0, _break_summary(explanation)
    assert explanation.graph_count == 1


def test_dropout_at_tp1_needs_no_rng_fork_and_compiles_whole():
    """TP = 1 with dropout on (training): the default generator serves, so still one graph."""
    model = _model(2, hidden_dropout=0.1, attention_dropout=0.1)
    model.train()
    ids, pos, labels = _batch()
    explanation = torch._dynamo.explain(model)(ids, pos, None, labels=labels)
    assert explanation.graph_break_count == 0, _break_summary(explanation)


def test_whole_bf16_model_compiles_as_one_graph_with_the_loss_backward():
    """fullgraph=True fails on any break; aot_eager also traces the cross entropy's backward."""
    results = []
    for compiled in (False, True):
        model = _model(2).bfloat16()
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        results.append(_loss_and_grads(run, model))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)


def test_enabled_layer_spans_keep_their_tree():
    """The disabled path changed; the enabled one must still nest self_attention/mlp under forward."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="layer", run_id="t"), 0, 1,
                                 span_exporter=spans)
    assert handle.is_exporting
    model = _model(2)
    ids, pos, labels = _batch()
    model(ids, pos, None, labels=labels)
    assert handle.force_flush(5000)
    finished = spans.get_finished_spans()
    forwards = {s.context.span_id: s for s in finished if s.name == "megatron.layer.forward"}
    assert sorted(s.attributes["megatron.layer_number"] for s in forwards.values()) == [1, 2]
    children = [s for s in finished if s.name in ("megatron.layer.self_attention", "megatron.layer.mlp")]
    assert len(children) == 4 and all(s.parent.span_id in forwards for s in children)


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        os.environ.get("MEGATRON_TEST_INDUCTOR") != "1",
        reason="inductor's C++ kernel builds take minutes on a small CPU; set MEGATRON_TEST_INDUCTOR=1")),
])
def test_compiled_transformer_layers_match_eager_and_keep_state_dict_names(backend, monkeypatch):
    """Per-layer compile vs eager: loss and every grad, state-dict names, strict load into an eager model.

    aot_eager runs the same Dynamo capture and AOT-autograd (functionalised forward + backward) as
    the default inductor backend, minus inductor's code generation, so it stays fast on CPU.
    """
    if backend != "inductor":
        real_compile = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": backend}))
    eager = _model(2)
    compiled = _model(2, compile_transformer_layers=True)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in name for name, _ in compiled.named_parameters())
    assert all(layer._compiled_call_impl is not None for layer in compiled.decoder.layers)
    assert eager.decoder.layers[0]._compiled_call_impl is None

    torch._dynamo.utils.counters.clear()
    eager_loss, eager_grads = _loss_and_grads(eager)
    compiled_loss, compiled_grads = _loss_and_grads(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "no layer was compiled"
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The checkpoint format does not see the compilation: an eager model loads it strictly.
    eager.load_state_dict(compiled.state_dict(), strict=True)


def test_compile_flag_flows_from_args_to_config():
    common = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "8",
              "--max-position-embeddings", "8", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
    off = core_transformer_config_from_args(validate_args(parse_args(args=common)))
    on = core_transformer_config_from_args(validate_args(parse_args(args=common + ["--compile-transformer-layers"])))
    assert off.compile_transformer_layers is False and on.compile_transformer_layers is True


# ---------------------------------------------------------------------------------------------
# The real training path: pretrain_gpt.model_provider wrapped by training.get_model (DDP, and
# gradient-accumulation fusion on, Megatron's default), in one gloo process.
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def pretrain_model():
    from dist_utils import single_rank_process_group
    from megatron.training.global_vars import set_args

    def build(extra=()):
        import pretrain_gpt
        from megatron.training.training import get_model

        args = validate_args(parse_args(args=[
            "--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
            "--seq-length", str(S), "--max-position-embeddings", str(S), "--micro-batch-size", str(B),
            "--train-iters", "1", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--use-cpu-initialization", *extra]))
        args.padded_vocab_size = V
        set_args(args)
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        return get_model(pretrain_gpt.model_provider)[0]

    with single_rank_process_group():
        yield build


@pytest.mark.timeout(120)
def test_pretrain_model_with_ddp_and_wgrad_fusion_compiles_without_breaks(pretrain_model):
    """Each fused linear used to set ``grad_added_to_main_grad`` inside its backward: 13 breaks at 2 layers."""
    ddp = pretrain_model()
    assert type(ddp).__name__ == "DistributedDataParallel"
    assert ddp.module.decoder.layers[0].mlp.linear_fc1.gradient_accumulation_fusion
    ids, pos, labels = _batch()
    explanation = torch._dynamo.explain(ddp)(ids, pos, None, labels=labels)
    assert explanation.graph_break_count == 0, _break_summary(explanation)
    assert explanation.graph_count == 1


@pytest.mark.timeout(120)
def test_compiled_pretrain_model_accumulates_the_same_main_grads(pretrain_model):
    """aot_eager compiles forward and backward of the DDP model; its main_grads over two micro-batches
    (fused wgrad into the buffer, the tied embedding's lookup grad through the DDP hook) equal eager."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        ddp = pretrain_model()
        run = torch.compile(ddp, backend="aot_eager", fullgraph=True) if compiled else ddp
        ddp.zero_grad_buffer()
        for seed in (1, 2):
            ids, pos, labels = _batch(seed)
            with ddp.no_sync():
                run(ids, pos, None, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        results.append({name: p.main_grad.clone() for name, p in ddp.module.named_parameters()})
    eager, compiled = results
    assert eager.keys() == compiled.keys()
    for name, grad in eager.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-6, msg=name)
