"""What every command shares beside the contract: CLI argument groups and Ctrl-C handling
(`cli_args`), the prompt sets (`prompts`), what the CPU offers (`cpu`) and the cache folder
(`cache`). Sits one layer above `contract` (its tree flags come from `contract.tree_config`)
and below everything else; imports nothing heavy (no torch, onnx or onnxruntime)."""
