"""Offline capacity planning for cross-datacenter prefill (`crossfill plan`).

kv_accounting (bytes per layer kind) <- hf_config / model_source (config.json and cited presets);
workload (length distributions), profiles (prefill/decode hardware), bandwidth (Phi and the link),
optimizer (offload threshold and pool split), calibrate (measured profiles from crossfill's engine),
report / plots (output), plan / commands (the command).
"""
