"""Running the exported graphs: the engine interface (:mod:`.base`), ONNX Runtime's engine and
its batch half (:mod:`.ort`, :mod:`.ort_batch`), native TensorRT (:mod:`.trt`) and the choice
between them (:mod:`.factory`), preallocated KV caches, window binding, sessions and execution
providers, the load-time probes, the prefix cache and the on-disk cache of measured costs.

May import ``core`` only.
"""
