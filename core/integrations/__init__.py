"""kvswap inside inference engines, through each engine's own extension point.

* :mod:`kvswap.integrations.vllm`: an offloading spec for vLLM's OffloadingConnector
  (imports vLLM; load it through ``spec_module_path``).
* :mod:`kvswap.integrations.sglang`: hooks on SGLang's HiCache host pools (an SGLang plugin,
  the entry point ``kvswap`` of ``sglang.srt.plugins``; imports SGLang when SGLang loads it).
* :mod:`kvswap.integrations.offload`: the engine-neutral parts it runs on (a worker of
  chunked host blocks over kvswap movers, the id mapping, the options); no engine needed.

Importing this package imports no engine.
"""
