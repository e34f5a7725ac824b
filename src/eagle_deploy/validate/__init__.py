"""`eagle-validate`: compare the exported graphs with an independent PyTorch reference."""
