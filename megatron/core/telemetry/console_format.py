"""One-line JSON of spans and metric snapshots for the console exporters: the SDK's ``to_json`` fields, compact.

The SDK's own formatters re-encode the process's resource (a dozen attributes, most of a span's line)
every time, and a metric snapshot's JSON is built by encoding and re-parsing every level of it; to get
one compact line the text then had to be parsed and encoded once more. That work runs on an exporter
thread while it holds the GIL, so the training thread waits for it. Here each line is encoded once, and
the resource (and a scope) is converted once while the object stays the same.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Optional

from opentelemetry.sdk.util import ns_to_iso_str
from opentelemetry.trace import format_span_id, format_trace_id

__all__ = ["SpanLineFormatter", "MetricsLineFormatter"]

_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _context(context) -> Dict[str, str]:
    return {"trace_id": f"0x{format_trace_id(context.trace_id)}", "span_id": f"0x{format_span_id(context.span_id)}",
            "trace_state": repr(context.trace_state)}


def _attributes(attributes) -> Optional[Dict[str, Any]]:
    return dict(attributes) if attributes is not None and not isinstance(attributes, dict) else attributes


class SpanLineFormatter:
    """``formatter`` of ``ConsoleSpanExporter``: ``span -> '{"name":...,"resource":{...}}\\n'`` with the keys,
    order and value formats of ``ReadableSpan.to_json`` (``indent=None``), minus the spaces."""

    def __init__(self) -> None:
        self._resource = (None, "null")  # (resource object, its JSON); replaced as one tuple: no lock

    def _resource_json(self, resource) -> str:
        cached, text = self._resource
        if resource is not cached:
            text = _encode(json.loads(resource.to_json())) if resource is not None else "null"
            self._resource = (resource, text)
        return text

    def __call__(self, span) -> str:
        status = {"status_code": str(span.status.status_code.name)}
        if span.status.description:
            status["description"] = span.status.description
        fields = {
            "name": span.name,
            "context": _context(span.context) if span.context else None,
            "kind": str(span.kind),
            "parent_id": f"0x{format_span_id(span.parent.span_id)}" if span.parent is not None else None,
            "start_time": ns_to_iso_str(span.start_time) if span.start_time else None,
            "end_time": ns_to_iso_str(span.end_time) if span.end_time else None,
            "status": status,
            "attributes": _attributes(span.attributes),
            "events": [{"name": event.name, "timestamp": ns_to_iso_str(event.timestamp),
                        "attributes": _attributes(event.attributes)} for event in span.events],
            "links": [{"context": _context(link.context), "attributes": _attributes(link.attributes)}
                      for link in span.links],
        }
        return f'{_encode(fields)[:-1]},"resource":{self._resource_json(span.resource)}}}\n'


class MetricsLineFormatter:
    """``formatter`` of ``ConsoleMetricExporter``: ``MetricsData -> '{"resource_metrics":[...]}\n'`` with the
    keys, order and values of ``MetricsData.to_json`` (``indent=None``), minus the spaces. Data points
    go through ``dataclasses.asdict``, as the SDK's do; the other levels are built directly."""

    def __init__(self) -> None:
        self._decoded: Dict[int, tuple] = {}  # id(resource or scope) -> (object, its to_json() parsed)

    def _parsed(self, obj) -> Any:
        cached = self._decoded.get(id(obj))
        if cached is None or cached[0] is not obj:
            cached = (obj, json.loads(obj.to_json(indent=None)))
            if len(self._decoded) > 64:  # one resource and a few scopes per process; bound it anyway
                self._decoded.clear()
            self._decoded[id(obj)] = cached
        return cached[1]

    @staticmethod
    def _data(data) -> Dict[str, Any]:
        out = {}
        for field in dataclasses.fields(data):
            value = getattr(data, field.name)
            out[field.name] = [dataclasses.asdict(point) for point in value] if field.name == "data_points" else value
        return out

    def __call__(self, metrics_data) -> str:
        resource_metrics = []
        for rm in metrics_data.resource_metrics:
            scopes = []
            for sm in rm.scope_metrics:
                metrics = [{"name": m.name, "description": m.description or "", "unit": m.unit or "",
                            "data": self._data(m.data)} for m in sm.metrics]
                scopes.append({"scope": self._parsed(sm.scope), "metrics": metrics, "schema_url": sm.schema_url})
            resource_metrics.append({"resource": self._parsed(rm.resource), "scope_metrics": scopes,
                                     "schema_url": rm.schema_url})
        return _encode({"resource_metrics": resource_metrics}) + "\n"
