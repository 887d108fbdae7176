"""Checkpoints: what a model on disk is, and loading it through the offloading experts runtime.

``checkpoint`` reads Hugging Face folders (config, tokenizer, the ``moetray.json`` sidecar)
and loads them with experts in the host store. Quantized files (GGUF, MXFP4, FP8) and the
discovery of local model stores live here too. May import torch, the public transformers API
(not its internals: those go through ``engine/experts/hf.py``), ``moetray.engine.experts`` and
``moetray.policy``.
"""
