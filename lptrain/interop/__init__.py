"""Interchange with the field's formats: Hugging Face model folders, both ways.

* :mod:`~lptrain.interop.hf_arch` -- which ``transformers`` architecture an lptrain model is
  (Llama, Qwen3, Mixtral, Qwen3-MoE), its ``config.json`` and the shape check on import;
* :mod:`~lptrain.interop.hf_weights` -- canonical lptrain tensors <-> Hugging Face tensors
  (fused QKV split per query group, ``[gate | up]`` split, vocabulary padding, experts);
* :mod:`~lptrain.interop.safetensors_io` -- sharded ``model.safetensors`` with its index;
* :mod:`~lptrain.interop.hf_export` -- ``lptrain export``: a run or checkpoint folder -> a
  Hugging Face folder (from the fp32 masters);
* :mod:`~lptrain.interop.hf_import` -- ``checkpoint.init_from_hf``: a Hugging Face folder ->
  the fp32 masters a fresh run starts from.

Nothing here imports ``transformers``: the folders are written and read with ``safetensors``
and JSON, and the tests load them with ``transformers`` itself to prove the mapping.
"""
