"""EAGLE draft heads as torch modules, read from and written to their published checkpoint
layouts."""
