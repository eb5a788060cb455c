"""Tracing: layer and loss tags, the jaxpr interpreter, the tracer, the graph matcher and the losses."""
