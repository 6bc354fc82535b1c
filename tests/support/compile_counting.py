"""A ``torch.compile`` backend that counts compilations: what a "compiles once, then replays" test asserts on."""

from __future__ import annotations


def counting_backend():
    """``(backend, graphs)``: a backend that runs each traced graph as it is (no inductor: the test is about how often
    Dynamo compiles, not what it compiles to), and the list of the graphs it was given, one per compilation
    (``fullgraph=True``: never two for one trace).

    A function, not an object holding the count: transformers' ``CompileConfig`` deep-copies its settings, which would
    copy an object's count away; a function is handed over as it is."""
    graphs = []

    def backend(graph_module, example_inputs, **options):  # CompileConfig passes its mode; nothing here to tune
        graphs.append(graph_module)
        return graph_module.forward

    return backend, graphs
