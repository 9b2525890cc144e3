"""LLM-aware endpoint picker: an Envoy ext_proc service that routes inference requests.

The plugin API lives in `epp.framework`; built-in plugins in `epp.scorers`; the model-server
side (vLLM launcher, disk-tier manager, simulator) in `epp.engine`.
"""
