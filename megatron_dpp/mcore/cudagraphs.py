"""Megatron-Core's local CUDA graphs (--cuda-graph-impl local): what this project needs of their
internals (the global record of whether graphs were created)."""
import contextlib


@contextlib.contextmanager
def eager_layers(config):
    """Evaluation with --cuda-graph-impl local: the layers' graphs were captured in training mode,
    dropout on, and replaying them would apply it. Megatron-Core's CudaGraphManager runs a layer
    eagerly in eval mode while no graph has been created (its _CudagraphGlobalRecord's flag), so
    the flag is lowered for the evaluation and restored after; its schedule's create_cudagraphs()
    at the end of the forward-only pass then finds nothing recorded and does nothing."""
    if getattr(config, "cuda_graph_impl", "none") != "local":
        yield
        return
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    created = _CudagraphGlobalRecord.cudagraph_created
    _CudagraphGlobalRecord.cudagraph_created = False
    try:
        yield
    finally:
        _CudagraphGlobalRecord.cudagraph_created = created
