"""The GPT forward's parts outside the decoder layers have spans too (layer group): embedding, output layer, loss."""
from megatron.core import telemetry as tel
from telemetry_testutil import clean_telemetry, finished  # noqa: F401
from test_compile import _batch, _model


def test_embedding_output_layer_and_loss_spans_sit_beside_the_layers():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="microbatch,layer", run_id="t"), 0, 1,
                                 span_exporter=spans)
    model = _model(2)
    ids, pos, labels = _batch()
    with tel.managed_span("microbatch", "megatron.microbatch.forward"):
        model(ids, pos, None, labels=labels)
    by_name = {}
    for span in (finished(handle, spans) and spans.get_finished_spans()):
        by_name.setdefault(span.name, []).append(span)
    parent = by_name["megatron.microbatch.forward"][0]
    ordered = sorted((s for name in ("megatron.embedding", "megatron.layer.forward", "megatron.output_layer",
                                     "megatron.loss") for s in by_name[name]), key=lambda s: s.start_time)
    assert [s.name for s in ordered] == ["megatron.embedding", "megatron.layer.forward", "megatron.layer.forward",
                                         "megatron.output_layer", "megatron.loss"]
    assert all(s.parent.span_id == parent.context.span_id for s in ordered)
    # Logits only (no labels): no loss span.
    spans.clear()
    model(ids, pos, None)
    names = [s.name for s in (finished(handle, spans) and spans.get_finished_spans())]
    assert "megatron.output_layer" in names and "megatron.loss" not in names
