"""P/D disaggregation benchmark: aggregated vs prefill/decode pools on simulated H100 replicas."""
