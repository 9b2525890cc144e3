"""Tracing into memory for tests: a picker's `RequestTracing` whose spans land in an `InMemorySpanExporter`,
and the finished spans read as a tree (by name, parent, trace)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from epp.tracing import RequestTracing


@contextlib.contextmanager
def in_memory_tracing() -> Iterator[tuple[RequestTracing, InMemorySpanExporter]]:
    """A `RequestTracing` exporting every span at its end into memory (the SDK's default sampler)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield RequestTracing(provider), exporter
    finally:
        provider.shutdown()


def span_id_hex(span: ReadableSpan) -> str:
    return f"{span.context.span_id:016x}"


def trace_id_hex(span: ReadableSpan) -> str:
    return f"{span.context.trace_id:032x}"


class SpanTree:
    """The spans an in-memory exporter holds (those ended so far), looked up by name and parent."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter

    @property
    def spans(self) -> Sequence[ReadableSpan]:
        return self.exporter.get_finished_spans()

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r} in {self.names()}"
        return found[0]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        """The spans whose parent is `parent`, in the order they started."""
        return sorted((s for s in self.spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
                      key=lambda s: s.start_time or 0)

    def child_names(self, parent: ReadableSpan) -> list[str]:
        return [s.name for s in self.children(parent)]

    def names(self) -> list[str]:
        return sorted(s.name for s in self.spans)
