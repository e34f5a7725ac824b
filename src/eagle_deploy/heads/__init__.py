"""EAGLE draft heads as torch modules, read from and written to their published checkpoint
layouts (one module per head kind, apart from one per checkpoint layout).

- `api`: `load_head` (the kind a folder's config or tensor names say), `random_head`,
  `save_head`, for either kind.
- `files`: what a head folder holds before its kind is known: `HeadCheckpointError`, the file
  names, the weights and config readers, `detect_layout`.
- `eagle12`, `eagle12_checkpoint`: the EAGLE-1/2 head (`EagleHead`) and its published layout.
- `eagle3`, `eagle3_config`, `eagle3_checkpoint`: the EAGLE-3 head (`Eagle3Head`), its config
  (`Eagle3Config`, the tapped layers) and its two published layouts (`eagle3`, `speculators`).

The modules are built on the exporter's export-friendly layers (`exporter.layers`,
`exporter.target`), so what is trained is what the draft graph computes; the exporter's draft
graphs (`exporter.draft`) wrap them. Never imported by `runtime`.
"""
